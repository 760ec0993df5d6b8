"""Shared fixtures: small random-weight models in real architectures, created locally."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvyard.models.create import create_model

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One `tiny` model per architecture, shared by the whole test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: create_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]

"""Shared fixtures: small random-weight models in real architectures, created locally, and the native kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvyard.kernels.build import KernelsUnavailable, find_compiler
from kvyard.kernels.ops import NativeKernels, load_native_kernels
from kvyard.testing.create_model import create_model

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One `tiny` model per architecture, shared by the whole test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: create_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def native_kernels() -> NativeKernels:
    """The native CPU kernels, built for this machine; skips where there is no C compiler."""
    try:
        return load_native_kernels()
    except KernelsUnavailable:
        assert find_compiler() is None, "a C compiler is here but the kernels did not build"
        pytest.skip("no C compiler here")

"""What a weight package says about itself (`kvyard_package.json`), read and checked without PyTorch, so a server
can start serving a package before PyTorch has loaded (kvyard.engine.fast_start.engine)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.models import PACKAGE_SCHEMES

PACKAGE_FILE = "kvyard_package.json"
PACKAGE_FORMAT = "kvyard-weights"
FORMAT_VERSION = 1
TENSORS_FILE = "model.safetensors"
GROUP_SIZE = 32  # int8 weights per fp32 scale, along a row: the native kernels' unit


class PackageError(ValueError):
    """A package that cannot be loaded: the message says what is wrong with it."""


@dataclass(frozen=True, slots=True)
class PackageInfo:
    format: str
    format_version: int
    weights: str  # the scheme: "int8", "fp16" or "bf16"
    group_size: int  # weights per int8 scale; 0 for the 16-bit schemes
    source_digest: str  # model_digest of the directory it was converted from
    tensors_sha256: str

    @property
    def weights_digest(self) -> str:
        """What the block-key namespace calls these weights: the same as converting the source at load time."""
        return self.source_digest + scheme_suffix(self.weights)


def scheme_suffix(scheme: str) -> str:
    """What a weight scheme adds to the checkpoint's digest in block keys ("" for the stored weights)."""
    if scheme == "none":
        return ""
    return f"+{scheme}-g{GROUP_SIZE}" if scheme == "int8" else f"+{scheme}"


def is_package(model_dir: str | Path) -> bool:
    return (Path(model_dir) / PACKAGE_FILE).is_file()


def group_size(scheme: str) -> int:
    return GROUP_SIZE if scheme == "int8" else 0


def read_info(package_dir: str | Path) -> PackageInfo:
    """The package's description, checked: PackageError naming what is wrong."""
    path = Path(package_dir) / PACKAGE_FILE
    try:
        raw: Any = json.loads(path.read_text())
        info = PackageInfo(**raw)
    except (OSError, json.JSONDecodeError, TypeError) as error:
        raise PackageError(f"{path} is not a kvyard package description: {error}") from None
    if info.format != PACKAGE_FORMAT:
        raise PackageError(f"{path}: format {info.format!r} is not {PACKAGE_FORMAT!r}")
    if info.format_version != FORMAT_VERSION:
        raise PackageError(
            f"{path}: format version {info.format_version} is not the one this kvyard reads "
            f"({FORMAT_VERSION}); convert the model again with this version"
        )
    if info.weights not in PACKAGE_SCHEMES or info.group_size != group_size(info.weights):
        raise PackageError(
            f"{path}: weights {info.weights!r} with groups of {info.group_size} cannot run here "
            f"(this kvyard runs {', '.join(PACKAGE_SCHEMES)}; int8 with groups of "
            f"{GROUP_SIZE})"
        )
    return info


def checked_tensors_file(package_dir: str | Path, info: PackageInfo) -> Path:
    """The package's safetensors file, once its SHA-256 matches the description (PackageError otherwise)."""
    tensors_path = Path(package_dir) / TENSORS_FILE
    if not tensors_path.is_file():
        raise PackageError(f"{tensors_path} is missing")
    if sha256_of(tensors_path) != info.tensors_sha256:
        raise PackageError(
            f"{tensors_path} does not match its SHA-256 in {PACKAGE_FILE}: the file is corrupt or truncated"
        )
    return tensors_path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()

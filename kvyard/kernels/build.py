"""Compile the kernel sources into one shared library, once per machine, cached under kvyard's cache root.

The library is built with -march=native (the vector paths need AVX2/FMA, the int8 matmul has an AVX-512
one, and the cache key covers the CPU's feature flags); where the compiler rejects that, with portable
flags, whose plain C paths compute the same thing more slowly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvyard.paths import cache_root

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
HEADER = SOURCE_DIR / "kvyard_kernels.h"  # declares every exported function; the bindings check against it
SOURCES = (
    "paged_attention.c",
    "prefill_attention.c",
    "kv_store.c",
    "small_linear.c",
    "small_linear_int8.c",
    "small_linear_half.c",
    "int8_to_bf16.c",
    "elementwise.c",
    "decode_layer.c",
)
# Included by the sources: part of the build fingerprint.
_HEADERS = ("kvyard_kernels.h", "vec_math.h", "half_float.h", "kv_rows.h", "row_dispatch.h", "prefetch.h")
NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
PORTABLE_FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# Always on: an exported function the header does not declare is a build error, not a silent extra.
_CHECK_FLAGS = ("-Werror=missing-prototypes",)


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be built or loaded on this machine (no compiler, a failed build, dlopen failed)."""


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def compiled_library() -> Path:
    """The cached library for this machine, built first if needed; KernelsUnavailable if it cannot be."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelsUnavailable("no C compiler (cc or gcc) on PATH")
    try:
        return _native_else_portable(compiler)
    except subprocess.CalledProcessError as error:
        raise KernelsUnavailable(f"the kernels failed to compile:\n{_stderr(error)}") from None
    except OSError as error:  # the compiler would not run, or the cache directory is not writable
        raise KernelsUnavailable(f"the kernels could not be built: {error}") from error


def _native_else_portable(compiler: str) -> Path:
    try:
        return _cached_build(compiler, NATIVE_FLAGS)
    except subprocess.CalledProcessError as error:
        logger.warning(
            "native CPU kernels failed to build with -march=native; trying portable flags:\n%s", _stderr(error)
        )
    return _cached_build(compiler, PORTABLE_FLAGS)


def compile_kernels(compiler: str, flags: Sequence[str], output: Path) -> None:
    """Build every kernel source into one shared library (the tests also build it with PORTABLE_FLAGS)."""
    sources = [str(SOURCE_DIR / name) for name in SOURCES]
    command = [compiler, *flags, *_CHECK_FLAGS, *sources, "-o", str(output), "-lm"]
    subprocess.run(command, check=True, capture_output=True)


def _cached_build(compiler: str, flags: Sequence[str]) -> Path:
    source = b"".join((SOURCE_DIR / name).read_bytes() for name in (*SOURCES, *_HEADERS))
    options = " ".join((*flags, *_CHECK_FLAGS)).encode()
    fingerprint = hashlib.sha256(source + options + _machine_fingerprint()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"kvyard-cpu-{fingerprint}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compile_kernels(compiler, flags, built)
        built.replace(target)  # atomic: concurrent builders each install a complete file
    return target


def _machine_fingerprint() -> bytes:
    """-march=native output depends on the CPU, so the cache key does too."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.machine()}|{flags}".encode()


def _stderr(error: subprocess.CalledProcessError) -> str:
    return error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else str(error)

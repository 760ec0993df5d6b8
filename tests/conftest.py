"""Shared fixtures: small random-weight models in real architectures, created locally, the native kernels, and a
server of the tiny Llama model."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_utils import ServerProcess, start_server

from kvyard.kernels.build import NATIVE_FLAGS, PORTABLE_FLAGS, KernelsUnavailable, compile_kernels, find_compiler
from kvyard.kernels.ops import NativeKernels, bind_kernels, load_native_kernels
from kvyard.testing.create_model import create_model

ARCHS = ("llama", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One `tiny` model per architecture, shared by the whole test session."""
    root = tmp_path_factory.mktemp("models")
    return {arch: create_model(arch, "tiny", root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def moe_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One `tiny` mixture-of-experts model per architecture (8 experts, 2 a token)."""
    root = tmp_path_factory.mktemp("moe-models")
    return {arch: create_model(arch, "tiny", root / arch) for arch in MOE_ARCHS}


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


@pytest.fixture(scope="session")
def portable_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kernels built without -march=native (on x86-64: without AVX2), so they take their plain C paths."""
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    library_path = tmp_path_factory.mktemp("portable") / "kernels_portable.so"
    compile_kernels(compiler, PORTABLE_FLAGS, library_path)
    return library_path


@pytest.fixture(scope="session")
def portable(portable_library: Path) -> NativeKernels:
    return bind_kernels(ctypes.CDLL(str(portable_library)), 2)


@pytest.fixture(scope="session")
def avx2_kernels(tmp_path_factory: pytest.TempPathFactory) -> NativeKernels:
    """On an AVX-512 machine, the kernels built without AVX-512, so that their AVX2 paths are tested here too (a
    machine without AVX-512 tests them through `native_kernels`)."""
    flags = _cpu_flags()
    if "avx512f" not in flags or "avx2" not in flags:
        pytest.skip("the native build is this machine's AVX2 build (or it has no AVX2)")
    compiler = find_compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    library_path = tmp_path_factory.mktemp("avx2") / "kernels_avx2.so"
    compile_kernels(compiler, (*NATIVE_FLAGS, "-mno-avx512f"), library_path)
    return bind_kernels(ctypes.CDLL(str(library_path)), 2)


@pytest.fixture(params=["native", "avx2"])
def vector_kernels(request: pytest.FixtureRequest) -> NativeKernels:
    """The kernels' vector paths: the native build, and on an AVX-512 machine the AVX2 build as well."""
    return request.getfixturevalue("native_kernels" if request.param == "native" else "avx2_kernels")


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@pytest.fixture(scope="module")
def llama_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A `kvyard serve` of the tiny Llama model as `tiny-llama`, one per test module."""
    process = start_server(llama_dir, tmp_path_factory.mktemp("logs"), "--served-model-name", "tiny-llama")
    yield process
    process.stop()

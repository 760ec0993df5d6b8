"""Native CPU kernels, compiled on first use with the system C compiler and cached per machine.

Only what PyTorch lacks or does slowly here: decode and prefill-chunk attention that read the
paged KV cache in place instead of gathering it into a temporary first, the few-row matmul of
a decode step, which must stream the weights at memory speed, and fused elementwise work. Without a compiler (or with
KVYARD_CPU_KERNELS=0) callers use the pure PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvyard.paths import cache_root

logger = logging.getLogger(__name__)

_SOURCES = ("paged_attention.c", "prefill_attention.c", "small_linear.c", "elementwise.c")
_HEADERS = ("vec_math.h",)  # included by the sources: part of the build fingerprint
_SOURCE_DIR = Path(__file__).parent / "csrc"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


@dataclass(frozen=True, slots=True)
class PagedDecodeKernel:
    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    num_threads: int

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, Hq, D]; caches: [slots, Hkv, D]; tables: [B, max_blocks] int64; lens: [B] int64."""
        q = q.contiguous()
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        out = torch.empty_like(q)
        workspace = torch.empty(self.num_threads * num_heads * max(1, max_context))
        self.function(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens), _ptr(out),
            _ptr(workspace), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
            max_context, ctypes.c_float(scale), self.num_threads,
        )  # fmt: skip
        return out


@dataclass(frozen=True, slots=True)
class PagedPrefillKernel:
    """Causal attention of a prefill chunk (the last query_len of context_len positions), fp32.

    Keys and values are read in place, either from the paged cache through a block table or from
    contiguous [context_len, Hkv, D] rows; rows may be strided but each row's heads are contiguous."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    num_threads: int

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_len: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q: [Tq, Hq, D]; caches: [slots, Hkv, D]; block_table: int64, covering context_len keys."""
        return self._run(q, k_cache, v_cache, block_table.contiguous(), context_len, block_size, scale)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Whole-context chunk: q, k, v hold every position ([T, Hq, D], [T, Hkv, D], [T, Hkv, D])."""
        # Contiguous keys are a paged cache of one block holding all of them.
        single_block = torch.zeros(1, dtype=torch.long)
        return self._run(q, k, v, single_block, k.shape[0], max(1, k.shape[0]), scale)

    def _run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_len: int,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        q, k_cache, v_cache = _heads_contiguous(q), _heads_contiguous(k_cache), _heads_contiguous(v_cache)
        if k_cache.stride(0) != v_cache.stride(0):
            k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        query_len, num_heads, head_dim = q.shape
        out = q.new_empty(query_len, num_heads, head_dim)
        status = self.function(
            _ptr(q), q.stride(0), _ptr(k_cache), _ptr(v_cache), k_cache.stride(0), _ptr(block_table), block_size,
            query_len, context_len, num_heads, k_cache.shape[1], head_dim, ctypes.c_float(scale), _ptr(out),
            self.num_threads,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("prefill attention kernel could not allocate its scratch")
        return out


@dataclass(frozen=True, slots=True)
class SmallLinearKernel:
    """`F.linear` for fp32 inputs of a few rows; weights [n, k] contiguous."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    num_threads: int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[0])
        self.function(
            _ptr(x), _ptr(weight), None if bias is None else _ptr(bias), _ptr(out), x.shape[0], weight.shape[0],
            weight.shape[1], self.num_threads,
        )  # fmt: skip
        return out


@dataclass(frozen=True, slots=True)
class ElementwiseKernels:
    """Fused residual-add + RMSNorm, in-place rotary embedding, SiLU-and-multiply, row-wise argmax; fp32."""

    add_rms_norm_function: ctypes._CFuncPtr  # type: ignore[name-defined]
    rotary_function: ctypes._CFuncPtr  # type: ignore[name-defined]
    silu_mul_function: ctypes._CFuncPtr  # type: ignore[name-defined]
    argmax_function: ctypes._CFuncPtr  # type: ignore[name-defined]

    def add_rms_norm(
        self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Adds x into `residual` in place (unless x is None) and returns the normalised residual."""
        out = torch.empty_like(residual)
        x = None if x is None else x.contiguous()  # bound to a name: the buffer must outlive the call
        rows, dim = residual.shape
        self.add_rms_norm_function(
            None if x is None else _ptr(x), _ptr(residual), _ptr(weight), _ptr(out), rows, dim, ctypes.c_float(eps)
        )
        return out

    def rotary(
        self, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """x: [T, H, D] with contiguous heads (rows may be strided), rotated in place."""
        num_tokens, num_heads, head_dim = x.shape
        self.rotary_function(
            _ptr(x), x.stride(0), num_tokens, num_heads, head_dim, _ptr(cos_table), _ptr(sin_table), _ptr(positions)
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [rows, 2 * dim] as [gate | up]; returns silu(gate) * up, [rows, dim]."""
        gate_up = gate_up.contiguous()
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, dim)
        self.silu_mul_function(_ptr(gate_up), _ptr(out), rows, dim)
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of a 2-D fp32 tensor (first index of the maximum; rows must hold no NaN)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.long)
        self.argmax_function(_ptr(x), x.shape[0], x.shape[1], _ptr(out))
        return out


@dataclass(frozen=True, slots=True)
class NativeKernels:
    paged_decode: PagedDecodeKernel
    paged_prefill: PagedPrefillKernel
    small_linear: SmallLinearKernel
    elementwise: ElementwiseKernels


def load_native_kernels() -> NativeKernels | None:
    """Compile (once per machine) and load the kernels; None if that is not possible here."""
    if os.environ.get("KVYARD_CPU_KERNELS", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_compiled_library()))
    except subprocess.CalledProcessError as error:
        logger.warning("native CPU kernels failed to compile; using the PyTorch path:\n%s", error.stderr.decode())
        return None
    except (OSError, FileNotFoundError) as error:
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", error)
        return None
    return bind_kernels(library, torch.get_num_threads())


def bind_kernels(library: ctypes.CDLL, threads: int) -> NativeKernels:
    """Declare the C signatures of a built kernel library and wrap its functions."""
    pointer, integer, int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    decode = library.kvyard_paged_decode_attention
    decode.restype = None
    decode.argtypes = [pointer] * 7 + [integer] * 6 + [int64, ctypes.c_float, integer]
    prefill = library.kvyard_paged_prefill_attention
    prefill.restype = integer
    prefill.argtypes = [
        pointer, int64, pointer, pointer, int64, pointer, integer, int64, int64, integer, integer, integer,
        ctypes.c_float, pointer, integer,
    ]  # fmt: skip
    linear = library.kvyard_small_linear
    linear.restype = None
    linear.argtypes = [pointer] * 4 + [int64] * 3 + [integer]
    add_rms_norm = library.kvyard_add_rms_norm
    add_rms_norm.restype = None
    add_rms_norm.argtypes = [pointer] * 4 + [int64] * 2 + [ctypes.c_float]
    rotary = library.kvyard_rotary
    rotary.restype = None
    rotary.argtypes = [pointer] + [int64] * 4 + [pointer] * 3
    silu_mul = library.kvyard_silu_mul
    silu_mul.restype = None
    silu_mul.argtypes = [pointer] * 2 + [int64] * 2
    argmax = library.kvyard_argmax_rows
    argmax.restype = None
    argmax.argtypes = [pointer, int64, int64, pointer]
    return NativeKernels(
        PagedDecodeKernel(decode, threads),
        PagedPrefillKernel(prefill, threads),
        SmallLinearKernel(linear, threads),
        ElementwiseKernels(add_rms_norm, rotary, silu_mul, argmax),
    )


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _compiled_library() -> Path:
    compiler = find_compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    source = b"".join((_SOURCE_DIR / name).read_bytes() for name in (*_SOURCES, *_HEADERS))
    fingerprint = hashlib.sha256(source + " ".join(_FLAGS).encode() + _machine_fingerprint()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"kvyard-cpu-{fingerprint}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compile_kernels(compiler, _FLAGS, built)
        built.replace(target)  # atomic: concurrent builders each install a complete file
    return target


def compile_kernels(compiler: str, flags: Sequence[str], output: Path) -> None:
    """Build every kernel source into one shared library (the tests also build it without -march=native)."""
    sources = [str(_SOURCE_DIR / name) for name in _SOURCES]
    subprocess.run([compiler, *flags, *sources, "-o", str(output), "-lm"], check=True, capture_output=True)


def _machine_fingerprint() -> bytes:
    """-march=native output depends on the CPU, so the cache key does too."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.machine()}|{flags}".encode()


def _heads_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, heads, dim] with any row stride, but each row's heads packed back to back."""
    if tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]:
        return tensor
    return tensor.contiguous()


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()

"""Native CPU kernels, compiled on first use with the system C compiler and cached per machine.

Only what PyTorch lacks: decode attention that reads the paged KV cache in place instead of
gathering it into a temporary first. Without a compiler (or with KVYARD_CPU_KERNELS=0) callers
use the pure PyTorch path, which computes the same thing.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from kvyard.paths import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
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
        workspace = torch.empty(self.num_threads * (num_heads // num_kv_heads) * max(1, max_context))
        self.function(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(context_lens), _ptr(out),
            _ptr(workspace), num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
            max_context, ctypes.c_float(scale), self.num_threads,
        )  # fmt: skip
        return out


def load_paged_decode_kernel() -> PagedDecodeKernel | None:
    """Compile (once per machine) and load the kernel; None if that is not possible here."""
    if os.environ.get("KVYARD_CPU_KERNELS", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_compiled_library()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", error)
        return None
    function = library.kvyard_paged_decode_attention
    function.restype = None
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    function.argtypes = [pointer] * 7 + [integer] * 6 + [ctypes.c_int64, ctypes.c_float, integer]
    return PagedDecodeKernel(function, torch.get_num_threads())


def _compiled_library() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    source = _SOURCE.read_bytes()
    fingerprint = hashlib.sha256(source + " ".join(_FLAGS).encode() + _machine_fingerprint()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_attention-{fingerprint}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        built.replace(target)  # atomic: concurrent builders each install a complete file
    return target


def _machine_fingerprint() -> bytes:
    """-march=native output depends on the CPU, so the cache key does too."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return f"{platform.machine()}|{flags}".encode()


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()

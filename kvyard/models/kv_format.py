"""The formats the paged KV cache stores keys and values in, and their conversion to and from compute dtype.

A layer's cache is `[2, num_slots, num_kv_heads, row]`. In fp32, fp16 and bf16 a row is `head_dim` values of
that dtype. In int8 a row is `head_dim` int8 values followed by the row's fp32 scale (4 bytes), the cache a
uint8 tensor: value = q * scale, scale = max|x| / 127, q = round-half-even(x / scale). One scale per token and
KV head, because a block fills one token at a time: a scale per block would be fixed before its later tokens
are seen (clipping them) or would have to re-quantize the block as it fills. The row costs head_dim + 4 bytes
(about 27 % of fp32 at head_dim 64). The native kernels (kvyard/kernels/csrc/kv_rows.h) store and read the same
bytes, rounding the same way, so either backend can read a block the other wrote.

The cache tensor's dtype names its format (uint8 meaning int8 rows), so layers need nothing else to read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvyard.kernels.ops import INT8_ROW_SCALE_BYTES as INT8_SCALE_BYTES

_STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.uint8}
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# How a block of each format is named in the block codec (fp32/fp16/bf16 as the torch dtype, as before).
_CODEC_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8-rowscale"}


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One of KV_CACHE_DTYPES (resolved: never auto)."""

    name: str

    @classmethod
    def resolve(cls, choice: str, compute_dtype: torch.dtype) -> KVFormat:
        """The format `kv_cache_dtype=choice` means for a model computing in `compute_dtype` (auto: the same)."""
        if choice == "auto":
            if compute_dtype not in _NAMES:
                raise ValueError(f"no KV cache format matches the model dtype {compute_dtype}")
            return cls(_NAMES[compute_dtype])
        if choice not in _STORAGE:
            raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_STORAGE)}, not {choice!r}")
        return cls(choice)

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE[self.name]

    @property
    def codec_name(self) -> str:
        return _CODEC_NAMES[self.name]

    def row_width(self, head_dim: int) -> int:
        """Elements of the storage dtype per row (one token's values for one KV head)."""
        return head_dim + INT8_SCALE_BYTES if self.name == "int8" else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * torch.empty(0, dtype=self.storage_dtype).element_size()

    def is_exact_for(self, compute_dtype: torch.dtype) -> bool:
        """Whether the cache holds keys and values exactly as computed (no rounding on store)."""
        return _NAMES.get(compute_dtype) == self.name

    def namespace_dtype(self, compute_dtype: torch.dtype) -> str:
        """The block-key namespace's dtype: the compute dtype, and the cache's format where it differs (the
        bytes differ, so blocks must never be shared)."""
        name = str(compute_dtype).removeprefix("torch.")
        return name if self.is_exact_for(compute_dtype) else f"{name}+kv-{self.name}"


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] of any float dtype as int8 rows with their scale: uint8 [..., head_dim + 4]."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(x / torch.where(scale == 0, 1.0, scale)).clamp_(-127, 127).to(torch.int8)
    return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)


def dequantize_int8_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_int8_rows` up to rounding: uint8 [..., head_dim + 4] -> [..., head_dim] of `dtype`."""
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    values = rows[..., :head_dim].view(torch.int8).to(torch.float32)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)


def to_storage(x: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] in the cache format whose tensor dtype is `storage_dtype`."""
    return quantize_int8_rows(x) if storage_dtype == torch.uint8 else x.to(storage_dtype)


def from_storage(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache ([..., row]) as [..., head_dim] values of `dtype` (no copy when already so)."""
    return dequantize_int8_rows(rows, dtype) if rows.dtype == torch.uint8 else rows.to(dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[slots] = x in the cache's format; cache [num_slots, Hkv, row], x [T, Hkv, head_dim]."""
    cache.index_copy_(0, slots, to_storage(x, cache.dtype))

"""The two attention backends, PyTorch SDPA and the native CPU kernels, and the choice between them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvyard.kernels.build import KernelsUnavailable
from kvyard.kernels.ops import NativeKernels, load_native_kernels
from kvyard.models import ATTENTION_BACKENDS
from kvyard.models.attention import AttentionBackend, AttentionMetadata, PrefillSpan, gather_blocks
from kvyard.models.kv_format import from_storage, store_rows

logger = logging.getLogger(__name__)


class AttentionBackendUnavailable(RuntimeError):
    """The backend asked for by name cannot run here (device, dtype, or the kernels would not build)."""


@dataclass(frozen=True, slots=True)
class TorchSDPABackend:
    """Plain PyTorch: gathers the context's KV blocks, widens them to the query's dtype and runs
    scaled_dot_product_attention. Any device, any dtype, any KV format."""

    name: ClassVar[str] = "torch"
    uses_masks: ClassVar[bool] = True

    def store(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store_rows(kv_cache[0], slots, k)
        store_rows(kv_cache[1], slots, v)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # The query heads of one KV group share its keys, so they ride along as extra query rows
        # ([B, Hkv, group, D]) instead of expanding K and V to every query head.
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[2]
        keys = _gather(kv_cache[0], meta.decode_block_tables, meta.block_size, q.dtype).transpose(1, 2)
        values = _gather(kv_cache[1], meta.decode_block_tables, meta.block_size, q.dtype).transpose(1, 2)
        grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.decode_mask, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if span.block_table is None:
            keys, values, mask = k, v, None
        else:
            keys = _gather(kv_cache[0], span.block_table, meta.block_size, q.dtype)[: span.context_len]
            values = _gather(kv_cache[1], span.block_table, meta.block_size, q.dtype)[: span.context_len]
            mask = span.mask
        # SDPA takes its fused CPU kernel only for 4-D inputs, hence the leading batch dim of 1.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class CPUNativeBackend:
    """The native kernels (`kvyard.kernels`): keys and values read in place through the block tables,
    causality and padding from positions and lengths, so no gather and no masks. fp32 activations on CPU,
    the cache in any KV format."""

    kernels: NativeKernels
    # Prefill attention as a bf16 model computes it (kvyard.engine's --matmul-dtype bfloat16, on a CPU with AMX
    # or AVX512-BF16): PyTorch's fused kernel over bf16 queries, keys and values, fp32 accumulation.
    bf16_prefill: bool = False
    name: ClassVar[str] = "native"
    uses_masks: ClassVar[bool] = False

    def store(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        _require_fp32_cpu(k, v)  # the kernels check the cache themselves
        self.kernels.store_kv(kv_cache[0], kv_cache[1], slots, k, v)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _require_fp32_cpu(q)
        max_context = int(meta.decode_block_tables.shape[1]) * meta.block_size
        return self.kernels.paged_decode(
            q,
            kv_cache[0],
            kv_cache[1],
            meta.decode_block_tables,
            meta.decode_context_lens,
            max_context,
            meta.block_size,
            scale,
        )

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _require_fp32_cpu(q, k, v)
        if self.bf16_prefill:
            return bf16_prefill_attention(q, k, v, kv_cache, span, meta.block_size, scale).float()
        kernel = self.kernels.paged_prefill
        # The kernel also beats SDPA's causal path on whole-context chunks (measured on the bench
        # preset's shapes, 16 to 2,500 tokens: 1.2-2x), so it takes those too.
        if span.block_table is None:
            return kernel.causal(q, k, v, scale)
        return kernel(q, kv_cache[0], kv_cache[1], span.block_table, span.context_len, meta.block_size, scale)


def bf16_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk's attention in bf16 through SDPA's fused CPU kernel, which multiplies with AMX where the
    CPU has it (2-core Xeon, bench preset's heads: 2.8x the native fp32 kernel on a whole 2,048-token context,
    1.4-2.9x where the chunk follows a cached prefix and needs a mask). q, k, v in fp32 or bf16; bf16
    [Tq, Hq, D] back (a transposed view)."""
    whole = span.context_len == span.query_len
    # A whole context's keys read back from a bf16 cache are this chunk's keys rounded to bf16: no gather.
    if span.block_table is None or (whole and kv_cache.dtype == torch.bfloat16):
        keys, values = k.to(torch.bfloat16), v.to(torch.bfloat16)
    else:
        keys = _gather(kv_cache[0], span.block_table, block_size, torch.bfloat16)[: span.context_len]
        values = _gather(kv_cache[1], span.block_table, block_size, torch.bfloat16)[: span.context_len]
    # SDPA takes its fused CPU kernel only for 4-D inputs, hence the leading batch dim of 1.
    out = F.scaled_dot_product_attention(
        q.to(torch.bfloat16).transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=None if whole else _bottom_right_causal(span.query_len, span.context_len),
        is_causal=whole,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _bottom_right_causal(query_len: int, context_len: int) -> torch.Tensor:
    """[query_len, context_len] True where a query may attend: the chunk's queries are the context's last."""
    query_pos = torch.arange(context_len - query_len, context_len)[:, None]
    return torch.arange(context_len)[None, :] <= query_pos


def select_attention_backend(
    choice: str, device: torch.device, dtype: torch.dtype, bf16_prefill: bool = False
) -> AttentionBackend:
    """The backend for a model computing in `dtype` on `device` (any KV format).

    "torch": SDPA. "native": the native kernels, else AttentionBackendUnavailable saying why. "auto":
    native where it can run (CPU, float32, kernels built), else SDPA. `bf16_prefill`: the native backend computes
    prefill attention in bf16 (CPUNativeBackend.bf16_prefill)."""
    if choice == "torch":
        return TorchSDPABackend()
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, not {choice!r}")
    reason = native_unsupported_reason(device, dtype)
    if reason is None:
        try:
            return CPUNativeBackend(load_native_kernels(), bf16_prefill)
        except KernelsUnavailable as error:
            reason = f"the native CPU kernels are unavailable: {error}"
            if choice == "auto":
                logger.warning("%s; using PyTorch SDPA attention", reason)
    if choice == "native":
        raise AttentionBackendUnavailable(f"attention_backend='native' cannot run here: {reason}")
    return TorchSDPABackend()


def native_unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the native kernels cannot serve a model computing in `dtype` on `device`; None if they can."""
    if device.type != "cpu":
        return f"the native kernels run on CPU only, and the device is {device}"
    if dtype != torch.float32:
        return f"the native kernels take float32 activations only, and the model's dtype is {dtype}"
    return None


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    return from_storage(gather_blocks(cache, block_ids, block_size), dtype)


def _require_fp32_cpu(*tensors: torch.Tensor) -> None:
    """The kernels read raw fp32 pointers: anything else must stop here, not read past a buffer."""
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            raise TypeError(
                f"the native attention kernels take float32 CPU tensors, not {tensor.dtype} on {tensor.device}"
            )

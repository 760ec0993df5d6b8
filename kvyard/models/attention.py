"""Paged attention in plain PyTorch (CPU and CUDA).

The KV cache of one layer is a tensor `[2, num_slots, num_kv_heads, head_dim]` where a slot is
`block_id * block_size + offset`. A step's tokens are laid out decodes first (one query token per
sequence), then prefill chunks. Everything that depends only on the batch layout (slot indices,
masks) is computed once per step in `AttentionMetadata` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens in a step, attending to `context_len` keys."""

    query_start: int
    query_len: int
    context_len: int
    # Slots of the whole context (cached prefix + this chunk); None when the chunk is the whole
    # context, so keys come straight from this step's projections.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, context_len] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] slot written by each new token
    num_decode_tokens: int
    decode_slots: torch.Tensor  # [num_decodes, max_context] slots to read (padded)
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_context] bool, True = attend
    prefills: list[PrefillSpan]


def build_attention_metadata(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Describe one step. Sequences with query_len == 1 must come first."""
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    slot_mapping: list[torch.Tensor] = []
    decode_rows: list[torch.Tensor] = []
    prefills: list[PrefillSpan] = []
    query_start = 0
    for i, (table, context_len, query_len) in enumerate(zip(block_tables, context_lens, query_lens)):
        slots = _context_slots(table, context_len, block_size)
        slot_mapping.append(slots[context_len - query_len :])
        if i < num_decodes:
            decode_rows.append(slots)
        else:
            prefills.append(_prefill_span(query_start, query_len, context_len, slots))
        query_start += query_len
    decode_slots, decode_mask = _pad_decode_rows(decode_rows)
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device),
        num_decode_tokens=num_decodes,
        decode_slots=decode_slots.to(device),
        decode_mask=decode_mask.to(device),
        prefills=[_to_device(span, device) for span in prefills],
    )


def _context_slots(block_table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table[: (context_len + block_size - 1) // block_size], dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:context_len]


def _prefill_span(query_start: int, query_len: int, context_len: int, slots: torch.Tensor) -> PrefillSpan:
    if context_len == query_len:
        return PrefillSpan(query_start, query_len, context_len, None, None)
    first_query_pos = context_len - query_len
    query_pos = torch.arange(first_query_pos, context_len)[:, None]
    key_pos = torch.arange(context_len)[None, :]
    return PrefillSpan(query_start, query_len, context_len, slots, key_pos <= query_pos)


def _pad_decode_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if not rows:
        return torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 1, 1, 0, dtype=torch.bool)
    lengths = torch.tensor([len(r) for r in rows])
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    mask = torch.arange(padded.shape[1])[None, :] < lengths[:, None]
    return padded, mask[:, None, None, :]


def _to_device(span: PrefillSpan, device: torch.device) -> PrefillSpan:
    if span.context_slots is None or span.mask is None:
        return span
    span.context_slots = span.context_slots.to(device)
    span.mask = span.mask.to(device)
    return span


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, Hq, D]."""
    kv_cache[0].index_copy_(0, meta.slot_mapping, k)
    kv_cache[1].index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], kv_cache, meta, scale)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, span, scale)
    return out


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    keys = kv_cache[0][meta.decode_slots].transpose(1, 2)  # [B, Hkv, S, D]
    values = kv_cache[1][meta.decode_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    if span.context_slots is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
    keys = kv_cache[0][span.context_slots].transpose(0, 1)  # [Hkv, S, D]
    values = kv_cache[1][span.context_slots].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=span.mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)

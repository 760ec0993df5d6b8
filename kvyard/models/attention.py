"""Paged attention: the layout of a step that every layer shares, and the backend interface.

The KV cache of one layer is a tensor `[2, num_slots, num_kv_heads, row]` where a slot is
`block_id * block_size + offset` and a row holds one token's keys (or values) of one KV head in the
cache's format (`kv_format`: head_dim values of fp32, fp16 or bf16, or int8 values and their scale).
A step's tokens are laid out decodes first (one query token per sequence), then prefill chunks.
Everything that depends only on the batch layout (slot indices, masks) is computed once per step in
`AttentionMetadata` and shared by all layers. How attention is computed over the cache is an
`AttentionBackend` (implementations in `attention_backends`), chosen once by the ModelRunner and
carried by each step's metadata, so every layer of a step uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Attention of this step's queries over the paged KV cache.

    The cache layout is shared with the block pool and the KV tier, which copy whole blocks, so every
    backend reads and writes that same layout (`kv_format`), byte for byte."""

    @property
    def name(self) -> str:
        """How the choice is spelt (`attention_backend="torch"`), for logs and tests."""
        ...

    @property
    def uses_masks(self) -> bool:
        """Whether it reads the additive masks in the metadata; without, they are not built at all."""
        ...

    def store(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's k, v ([T, Hkv, D]) into the cache's rows `slots`, converted to its format."""
        ...

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [num_decodes, Hq, D], one query per sequence, against the keys of `meta.decode_block_tables`."""
        ...

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
        """One sequence's chunk, causal: q [query_len, Hq, D]; k, v [query_len, Hkv, D], this chunk's
        projections (already in the cache too). Returns [query_len, Hq, D]."""
        ...


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens in a step, attending to `context_len` keys."""

    query_start: int
    query_len: int
    context_len: int
    # Blocks of the whole context (cached prefix + this chunk) and the additive causal mask
    # [query_len, context_len]; both None when the chunk is the whole context and the cache holds
    # keys exactly, so keys come straight from this step's projections. The mask is also None for a
    # backend without masks.
    block_table: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [num_tokens] slot written by each new token
    block_size: int
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size]; None without masks
    decode_context_lens: torch.Tensor  # [num_decodes] int64
    prefills: list[PrefillSpan]


def build_attention_metadata(
    backend: AttentionBackend,
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    keys_from_cache: bool = False,
) -> AttentionMetadata:
    """Describe one step for `backend`; `dtype` is the model's. Sequences with query_len == 1 must come first.

    `keys_from_cache`: every prefill chunk reads its keys from the cache, even one that is the whole context.
    For a cache that rounds what it stores (fp16, int8 on an fp32 model), so that a prompt attends to the
    same keys whether its prefix was cached or not."""
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    with_masks = backend.uses_masks
    prefills: list[PrefillSpan] = []
    query_start = num_decodes
    for table, context_len, query_len in zip(
        block_tables[num_decodes:], context_lens[num_decodes:], query_lens[num_decodes:]
    ):
        prefills.append(
            _prefill_span(
                query_start, query_len, context_len, table, block_size, dtype, device, with_masks, keys_from_cache
            )
        )
        query_start += query_len
    decode_tables = _decode_tables(block_tables[:num_decodes], context_lens[:num_decodes], block_size)
    decode_mask = _decode_mask(context_lens[:num_decodes], decode_tables, block_size, dtype) if with_masks else None
    return AttentionMetadata(
        backend=backend,
        slot_mapping=_slot_mapping(block_tables, context_lens, query_lens, block_size).to(device),
        block_size=block_size,
        num_decode_tokens=num_decodes,
        decode_block_tables=decode_tables.to(device),
        decode_mask=decode_mask.to(device) if decode_mask is not None else None,
        decode_context_lens=torch.tensor(context_lens[:num_decodes], dtype=torch.long, device=device),
        prefills=prefills,
    )


def build_scattered_metadata(
    backend: AttentionBackend,
    block_table: list[int],
    positions: list[int],
    context_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AttentionMetadata:
    """One sequence whose queries sit at any increasing `positions` below `context_len`, each attending to the
    cache's keys at positions up to its own; the other positions' keys are already in the cache. For a backend
    with masks only (the causal mask is what places the queries)."""
    if not backend.uses_masks:
        raise ValueError(f"the {backend.name!r} attention backend takes contiguous queries only")
    num_blocks = -(-context_len // block_size)
    table = torch.tensor(block_table[:num_blocks], dtype=torch.long)
    query_pos = torch.tensor(positions, dtype=torch.long)
    slots = table[query_pos // block_size] * block_size + query_pos % block_size
    key_pos = torch.arange(context_len)[None, :]
    mask = torch.zeros(len(positions), context_len, dtype=dtype).masked_fill(
        key_pos > query_pos[:, None], float("-inf")
    )
    span = PrefillSpan(0, len(positions), context_len, table.to(device), mask.to(device))
    return AttentionMetadata(
        backend=backend,
        slot_mapping=slots.to(device),
        block_size=block_size,
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long, device=device),
        decode_mask=None,
        decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
        prefills=[span],
    )


def _slot_mapping(
    block_tables: list[list[int]], context_lens: list[int], query_lens: list[int], block_size: int
) -> torch.Tensor:
    positions: list[int] = []
    blocks: list[int] = []
    for table, context_len, query_len in zip(block_tables, context_lens, query_lens):
        span = range(context_len - query_len, context_len)
        positions.extend(span)
        blocks.extend(table[p // block_size] for p in span)
    pos = torch.tensor(positions, dtype=torch.long)
    return torch.tensor(blocks, dtype=torch.long) * block_size + pos % block_size


def _prefill_span(
    query_start: int,
    query_len: int,
    context_len: int,
    block_table: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    with_mask: bool,
    keys_from_cache: bool,
) -> PrefillSpan:
    if context_len == query_len and not keys_from_cache:
        return PrefillSpan(query_start, query_len, context_len, None, None)
    num_blocks = -(-context_len // block_size)
    table = torch.tensor(block_table[:num_blocks], dtype=torch.long).to(device)
    if not with_mask:
        return PrefillSpan(query_start, query_len, context_len, table, None)
    query_pos = torch.arange(context_len - query_len, context_len)[:, None]
    key_pos = torch.arange(context_len)[None, :]
    mask = torch.zeros(query_len, context_len, dtype=dtype).masked_fill(key_pos > query_pos, float("-inf"))
    return PrefillSpan(query_start, query_len, context_len, table, mask.to(device))


def _decode_tables(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> torch.Tensor:
    used = [-(-n // block_size) for n in context_lens]
    max_blocks = max(used, default=0)
    rows = [table[:n] + [0] * (max_blocks - n) for table, n in zip(block_tables, used)]
    return torch.tensor(rows, dtype=torch.long).view(len(rows), max_blocks)


def _decode_mask(context_lens: list[int], tables: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_decodes, 1, 1, max_blocks * block_size]: 0 for real keys, -inf for padding."""
    key_pos = torch.arange(tables.shape[1] * block_size)[None, :]
    lengths = torch.tensor(context_lens, dtype=torch.long)[:, None]
    mask = torch.zeros(len(context_lens), key_pos.shape[1], dtype=dtype).masked_fill(key_pos >= lengths, float("-inf"))
    return mask[:, None, None, :]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows of `cache` ([num_slots, Hkv, W]) for whole blocks: [*block_ids.shape[:-1], n*block_size, Hkv, W]."""
    num_kv_heads, row_width = cache.shape[1], cache.shape[2]
    per_block = cache.view(-1, block_size * num_kv_heads * row_width)
    rows = per_block.index_select(0, block_ids.flatten())
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, row_width)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Writes k, v into the cache; returns [T, Hq, D]."""
    meta.backend.store(kv_cache, meta.slot_mapping, k, v)
    if not meta.prefills:  # a decode step: no output buffer to assemble
        return meta.backend.decode(q, kv_cache, meta, scale)
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        out[:num_decodes] = meta.backend.decode(q[:num_decodes], kv_cache, meta, scale)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        out[rows] = meta.backend.prefill(q[rows], k[rows], v[rows], kv_cache, span, meta, scale)
    return out

"""Multi-head latent attention (DeepSeek-V2/V3): what a token leaves behind for later tokens is one compressed row,
not a key and a value per head.

Each token's hidden state is projected to a latent `c` of `kv_lora_rank` values (normalized) and one rotary key
`k_pe` of `qk_rope_head_dim` values shared by every head; the row `c ‖ k_pe` is all that is cached. A head's key
is `W_UK c` beside `k_pe`, its value `W_UV c` (`kv_b_proj` holds W_UK and W_UV). Attention runs in the latent space
instead of expanding them (the "absorbed" form): a head's query part without position is turned into latent space
once, `q_lat = q_nope W_UK`, so that

    score(t, s) = scale * (q_lat(t) · c(s) + q_pe(t) · k_pe(s)),   out(t) = W_UV (Σ_s softmax(score) c(s))

which equals expanding every key and value and attending to them, in real arithmetic, at a cache of
kv_lora_rank + qk_rope_head_dim values per token per layer (576 for DeepSeek-V3, against 2 x 128 x 192 expanded).

Rotary dimensions are rotated the rotate-half way (kvyard's RotaryEmbedding); checkpoints that pair dimensions
interleaved (DeepSeek's `rope_interleave`) have their rotary rows reordered at load (`deinterleave_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvyard.models.attention import AttentionMetadata, gather_blocks
from kvyard.models.config import LatentConfig, ModelConfig
from kvyard.models.kv_format import from_storage, store_rows
from kvyard.models.layers import Linear, RMSNorm, RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # DeepSeek normalizes both latents with this, whatever the model's rms_norm_eps


class LatentAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, latent: LatentConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.latent = latent
        self.rotary = rotary
        query_size = num_heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim)
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if latent.q_lora_rank:
            self.q_a_proj = Linear(hidden_size, latent.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(latent.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(latent.q_lora_rank, query_size, bias=False)
        else:
            self.q_proj = Linear(hidden_size, query_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, latent.row_width, bias=False)
        self.kv_a_layernorm = RMSNorm(latent.kv_lora_rank, LATENT_NORM_EPS)
        up_rows = num_heads * (latent.qk_nope_head_dim + latent.v_head_dim)
        self.kv_b_proj = LatentUpProjection(up_rows, latent.kv_lora_rank)
        self.o_proj = Linear(num_heads * latent.v_head_dim, hidden_size, bias=False)

    def project(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, nope], q_pe [T, H, rope] rotated, rows [T, kv_lora_rank + rope]: what the cache keeps)."""
        latent, num_tokens = self.latent, hidden.shape[0]
        if self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None:
            queries = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            assert self.q_proj is not None
            queries = self.q_proj(hidden)
        queries = queries.view(num_tokens, self.num_heads, latent.qk_nope_head_dim + latent.qk_rope_head_dim)
        q_nope, q_pe = queries.split([latent.qk_nope_head_dim, latent.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        c, k_pe = compressed.split([latent.kv_lora_rank, latent.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous().view(num_tokens, 1, -1))
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c), k_pe.view(num_tokens, -1)], dim=-1)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A step's tokens (decodes first, then prefill chunks) over the paged cache [1, slots, 1, row]: each token's
        row is stored at its slot, then each attends to its sequence's rows up to its own position."""
        q_nope, q_pe, rows = self.project(positions, hidden)
        store_rows(kv_cache[0], meta.slot_mapping, rows[:, None, :])
        out = hidden.new_empty(hidden.shape[0], self.o_proj.in_features)
        decodes = meta.num_decode_tokens
        if decodes:
            context = _gathered(kv_cache[0], meta.decode_block_tables, meta.block_size, q_nope.dtype)
            hidden_rows = (
                torch.arange(context.shape[1], device=context.device)[None, :] >= meta.decode_context_lens[:, None]
            )
            mask = torch.zeros(hidden_rows.shape, dtype=q_nope.dtype, device=context.device).masked_fill(
                hidden_rows, -torch.inf
            )
            # The heads share the one cached row a token has: they ride along as query rows of one head.
            query = self._latent_query(q_nope[:decodes, None], q_pe[:decodes, None]).transpose(1, 2)
            mixed = F.scaled_dot_product_attention(
                query,
                context[:, None],
                context[:, None],
                attn_mask=mask[:, None, None],
                scale=self.latent.softmax_scale,
            )
            out[:decodes] = self._values(mixed.transpose(1, 2))[:, 0]
        for span in meta.prefills:
            chunk = slice(span.query_start, span.query_start + span.query_len)
            causal_mask = None
            if span.block_table is None:  # the whole context is this chunk, exactly as computed
                context = rows[chunk][None]
            else:
                table = span.block_table[None]
                context = _gathered(kv_cache[0], table, meta.block_size, q_nope.dtype)[:, : span.context_len]
                causal_mask = _causal(span.context_len - span.query_len, span.query_len, span.context_len, q_nope)
            out[chunk] = self._attend(q_nope[chunk][None], q_pe[chunk][None], context, causal_mask, causal=True)[0]
        return self.o_proj(out)

    def attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One sequence's queries [T, H, ·] over its rows [S, kv_lora_rank + rope], `mask` [T, S] additive (None:
        every row visible); the attention's output through o_proj, [T, hidden]."""
        out = self._attend(q_nope[None], q_pe[None], rows[None], mask, causal=False)[0]
        return self.o_proj(out)

    def _attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None, causal: bool
    ) -> torch.Tensor:
        """Queries [B, T, H, ·] over rows [B, S, row]; `mask` [T, S] additive, shared by the batch, else (None) causal
        from the first row when `causal`, every row visible when not; returns [B, T, H * v_head_dim]."""
        query = self._latent_query(q_nope, q_pe)
        keys = rows[:, None]  # one cached head, shared by every query head
        mixed = F.scaled_dot_product_attention(
            query,
            keys,
            keys,
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=self.latent.softmax_scale,
            enable_gqa=True,
        )
        return self._values(mixed)

    def _latent_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[B, H, T, kv_lora_rank + rope]: each head's query turned into latent space beside its rotary part, the
        row a cached row is scored against."""
        w_uk = self._up_weights()[0]
        return torch.cat([torch.einsum("bthd,hdr->bhtr", q_nope, w_uk), q_pe.transpose(1, 2)], dim=-1)

    def _values(self, mixed: torch.Tensor) -> torch.Tensor:
        """[B, H, T, row] mixtures of cached rows (their latent part is the heads' values before W_UV) to
        [B, T, H * v_head_dim]."""
        w_uv = self._up_weights()[1]
        out = torch.einsum("hvr,bhtr->bthv", w_uv, mixed[..., : self.latent.kv_lora_rank])
        return out.reshape(out.shape[0], out.shape[1], self.num_heads * self.latent.v_head_dim)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]) from kv_b_proj."""
        latent = self.latent
        weight = self.kv_b_proj.weight.view(self.num_heads, latent.qk_nope_head_dim + latent.v_head_dim, -1)
        w_uk, w_uv = weight.split([latent.qk_nope_head_dim, latent.v_head_dim], dim=1)
        return w_uk, w_uv


def _gathered(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, blocks * block_size, row]: the rows of each table's blocks (one cached head), as `dtype`."""
    return from_storage(gather_blocks(cache, block_tables, block_size), dtype)[:, :, 0]


def _causal(first: int, query_len: int, context_len: int, like: torch.Tensor) -> torch.Tensor:
    """[query_len, context_len] additive mask: query i (at position first + i) sees keys up to its position."""
    query = torch.arange(first, first + query_len, device=like.device)[:, None]
    keys = torch.arange(context_len, device=like.device)[None, :]
    return torch.zeros(query_len, context_len, dtype=like.dtype, device=like.device).masked_fill(
        keys > query, -torch.inf
    )


class LatentUpProjection(nn.Module):
    """kv_b_proj: every head's W_UK and W_UV, [heads * (nope + v), kv_lora_rank]. Read as matrices by the absorbed
    attention, never applied as a linear layer, so weight conversions that swap linear layers leave it be."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


def deinterleave_rows(weight: torch.Tensor, head_width: int, rope_offset: int, rope_dim: int) -> torch.Tensor:
    """A projection's output rows with each head's rotary rows reordered from pairs (x0, x1), (x2, x3), ... to
    (x0, x2, ..., x1, x3, ...): the rotate-half layout that gives the interleaved rotation's result."""
    rows = weight.view(-1, head_width, *weight.shape[1:])
    rope = rows[:, rope_offset : rope_offset + rope_dim]
    reordered = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    out = rows.clone()
    out[:, rope_offset : rope_offset + rope_dim] = reordered
    return out.view_as(weight)


def latent_checkpoint_tensor(module: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A latent attention checkpoint tensor as kvyard's module takes it: the query projection's and the latent
    projection's rotary rows reordered to rotate-half where the checkpoint pairs them interleaved."""
    latent = config.latent
    if latent is None or not config.raw.get("rope_interleave", True):
        return tensor
    rope = latent.qk_rope_head_dim
    if module in ("q_proj", "q_b_proj"):
        return deinterleave_rows(tensor, latent.qk_nope_head_dim + rope, latent.qk_nope_head_dim, rope)
    if module == "kv_a_proj_with_mqa":
        return deinterleave_rows(tensor, latent.row_width, latent.kv_lora_rank, rope)
    return tensor

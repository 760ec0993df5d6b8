"""Blending: a prompt's prefill that reuses cached keys and values of text that moved (segments), recomputing
only some of its tokens.

Reused keys are rotated to their new positions (rotary embeddings compose, so this part is exact up to rounding).
What reuse cannot fix is that those keys and values were computed after other text: from the second layer on,
every token's keys and values depend on what came before it. Blending recomputes, through every layer, the prompt's
tokens that no cache holds, its last token (whose logits are sampled), the first tokens of each moved run, and a
fraction of the other reused tokens; the rest keep their reused keys and values, and the recomputed tokens attend
to them. Which reused tokens are recomputed is the selection:

- "deviation" (CacheBlend's idea): the first layer is computed for every token, its output gives every token's
  keys and values at the second layer, and the reused tokens whose second-layer keys and values differ most from
  the reused ones are recomputed. One full layer more, and a choice made from evidence.
- "leading" (EPIC's idea): the first tokens of each run, no measurement; the cheapest.

With a recompute fraction of 1 every token is recomputed: the result is the full prefill's, computed through the
masked attention path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from kvyard.engine.blend.segments import SegmentMatch, runs_of
from kvyard.engine.blend.settings import BlendSettings
from kvyard.models.attention import build_scattered_metadata
from kvyard.models.attention_backends import TorchSDPABackend
from kvyard.models.decoder import DecoderLayer
from kvyard.models.kv_format import from_storage, store_rows

if TYPE_CHECKING:  # the runner imports this module
    from kvyard.engine.runners.model_runner import PagedModel


# Recomputed tokens run through the layers this many at a time: the masked attention's mask is this many rows by
# the context, in the model's dtype (128 MB of fp32 at a 64k context).
SCATTERED_CHUNK_TOKENS = 512
FIRST_LAYER_CHUNK_TOKENS = 2048  # the deviation selection's first layer over every new token, a chunk at a time


@dataclass(frozen=True, slots=True)
class BlendResult:
    hidden: torch.Tensor  # [1, hidden_size]: the last prompt token's final hidden state
    reused_tokens: int  # prompt tokens whose keys and values came from segments (recomputed or not)
    recomputed_tokens: int  # of those, recomputed through every layer


def install_segments(paged: PagedModel, matches: Sequence[SegmentMatch], block_table: list[int], layers: range) -> None:
    """Copy the matched blocks' keys and values into the prompt's blocks at its positions, keys rotated there."""
    if not matches:
        return
    size = paged.block_size
    within = torch.arange(size)
    sources = torch.cat([m.block_id * size + within for m in matches])
    new_positions = torch.cat([m.new_start + within for m in matches])
    table = torch.tensor(block_table, dtype=torch.long)
    targets = table[new_positions // size] * size + new_positions % size
    offsets = torch.tensor([m.offset for m in matches], dtype=torch.long).repeat_interleave(size)
    device = paged.device
    sources, targets, offsets = sources.to(device), targets.to(device), offsets.to(device)
    rotary = paged.model.rotary
    for layer in layers:
        cache = paged.kv_caches[layer]
        keys = from_storage(cache[0].index_select(0, sources), torch.float32)
        store_rows(cache[0], targets, rotary.shift(keys, offsets))
        cache[1].index_copy_(0, targets, cache[1].index_select(0, sources))


def blend_prefill(
    paged: PagedModel,
    prompt: Sequence[int],
    block_table: list[int],
    num_cached: int,
    matches: Sequence[SegmentMatch],
    settings: BlendSettings,
) -> BlendResult:
    """Fill the cache for prompt[num_cached:] (the first `num_cached` tokens are already there, exactly) from
    `matches` (all at or after num_cached) and the tokens blending recomputes; `block_table` covers the prompt.
    The caller holds torch.inference_mode."""
    size, total = paged.block_size, len(prompt)
    reused = {p for m in matches for p in range(m.new_start, m.new_start + size)}
    if any(p < num_cached or p >= total for p in reused):
        raise ValueError("segment matches must lie between the cached prefix and the prompt's end")
    num_layers = len(paged.model.model.layers)
    forced = _always_recomputed(total, num_cached, reused, matches, settings.leading_tokens, size)
    budget = math.ceil(settings.recompute_fraction * len(reused - forced))
    deviation = settings.selection == "deviation" and num_layers > 1 and budget > 0
    install_segments(paged, matches, block_table, range(1 if deviation else 0, num_layers))
    if deviation:
        return _blend_by_deviation(paged, prompt, block_table, num_cached, reused, forced, budget)
    extra = _leading_fill(matches, forced, budget, size)
    selected = sorted(forced | extra)
    ids = torch.tensor([prompt[p] for p in selected], device=paged.device)
    stream = paged.model.model.embed_tokens(ids)
    hidden = _layers_over(paged, stream, selected, block_table, 0)
    return BlendResult(hidden, len(reused), len(reused & set(selected)))


def _always_recomputed(
    total: int,
    num_cached: int,
    reused: set[int],
    matches: Sequence[SegmentMatch],
    leading_tokens: int,
    size: int,
) -> set[int]:
    forced = {p for p in range(num_cached, total) if p not in reused} | {total - 1}
    for start, length in runs_of(matches, size):
        forced.update(range(start, start + min(leading_tokens, length)))
    return forced


def _leading_fill(matches: Sequence[SegmentMatch], forced: set[int], budget: int, size: int) -> set[int]:
    """`budget` reused tokens, the first ones of every run, in proportion to the runs' lengths."""
    runs = runs_of(matches, size)
    reused_total = sum(length for _, length in runs)
    chosen: set[int] = set()
    for start, length in runs:
        share = math.ceil(budget * length / reused_total) if reused_total else 0
        free = [p for p in range(start, start + length) if p not in forced]
        chosen.update(free[:share])
    return chosen


def _blend_by_deviation(
    paged: PagedModel,
    prompt: Sequence[int],
    block_table: list[int],
    num_cached: int,
    reused: set[int],
    forced: set[int],
    budget: int,
) -> BlendResult:
    """The first layer over every new token (in chunks, as a chunked prefill); its second-layer keys and values
    against the reused ones choose."""
    total, device = len(prompt), paged.device
    layers = paged.model.model.layers
    second = cast(DecoderLayer, layers[1])
    streams: list[torch.Tensor] = []
    deviation = torch.zeros(total - num_cached, device=device)
    for begin in range(num_cached, total, FIRST_LAYER_CHUNK_TOKENS):
        end = min(total, begin + FIRST_LAYER_CHUNK_TOKENS)
        positions = torch.arange(begin, end, device=device)
        meta = paged.metadata([block_table], [end], [end - begin])
        embedded = paged.model.model.embed_tokens(torch.tensor(list(prompt[begin:end]), device=device))
        hidden, residual = layers[0](positions, embedded, None, paged.kv_caches[0], meta)
        streams.append(hidden + residual)
        _, keys, values = second.self_attn.project(positions, second.input_layernorm(streams[-1]))
        chunk_deviation = _deviation(paged, block_table, range(begin, end), keys, values)
        deviation[begin - num_cached : end - num_cached] = chunk_deviation
    candidates = sorted(reused - forced)
    rows = torch.tensor(candidates, dtype=torch.long, device=device) - num_cached
    top = torch.topk(deviation[rows], min(budget, len(candidates))).indices.tolist()
    selected = sorted(forced | {candidates[i] for i in top})
    picked = torch.tensor(selected, dtype=torch.long, device=device) - num_cached
    out = _layers_over(paged, torch.cat(streams)[picked], selected, block_table, 1)
    return BlendResult(out, len(reused), len(reused & set(selected)))


def _deviation(
    paged: PagedModel, block_table: list[int], positions: range, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Per position: squared distance of freshly computed second-layer keys and values from those in the cache
    (reused ones; for positions no segment filled, whatever the block held: they are recomputed anyway)."""
    size = paged.block_size
    where = torch.tensor(positions, dtype=torch.long)
    slots = (torch.tensor(block_table, dtype=torch.long)[where // size] * size + where % size).to(paged.device)
    cache = paged.kv_caches[1]
    old_keys = from_storage(cache[0].index_select(0, slots), keys.dtype)
    old_values = from_storage(cache[1].index_select(0, slots), values.dtype)
    return (keys - old_keys).square().sum(dim=(1, 2)) + (values - old_values).square().sum(dim=(1, 2))


def _layers_over(
    paged: PagedModel, stream: torch.Tensor, positions: list[int], block_table: list[int], first_layer: int
) -> torch.Tensor:
    """Run layers first_layer.. over the tokens at `positions` (their residual stream entering that layer), each
    attending to the cache up to its position, in chunks of positions in order (a chunk's tokens attend to the
    earlier chunks' keys and values, written by then, as a chunked prefill's do); returns the final hidden state
    of the last one [1, hidden_size]."""
    backend, device = TorchSDPABackend(), paged.device
    layers = list(zip(paged.model.model.layers[first_layer:], paged.kv_caches[first_layer:]))
    hidden = residual = stream[:0]
    for begin in range(0, len(positions), SCATTERED_CHUNK_TOKENS):
        chunk = positions[begin : begin + SCATTERED_CHUNK_TOKENS]
        context = chunk[-1] + 1
        meta = build_scattered_metadata(backend, block_table, chunk, context, paged.block_size, paged.dtype, device)
        where = torch.tensor(chunk, device=device)
        hidden, residual_or_none = stream[begin : begin + len(chunk)], None
        for layer, cache in layers:
            hidden, residual_or_none = layer(where, hidden, residual_or_none, cache, meta)
        if residual_or_none is None:
            raise ValueError("blending runs at least one layer over the recomputed tokens")
        residual = residual_or_none
    return paged.model.model.norm.add_and_norm(hidden[-1:], residual[-1:])[0]

"""Segments: full blocks of KV found by their own tokens, wherever in a prompt those tokens now sit.

A prefix key (kvyard.kvcache.block_key) names a block by everything before it, so a prompt whose start changed
finds nothing after the change. A segment is named by its own `block_size` tokens and the namespace root (model,
dtype, block size, cache salt: blocks never cross tenants), and remembers the position it was computed at. A
prompt is searched at every offset, not only at block boundaries: text that moved by any number of tokens is
still found. Windows are screened with kvyard.kvcache.segment_key's hash over all offsets at once (numpy), and
every candidate's tokens are compared exactly, so a hash collision costs a comparison, never a wrong block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvyard.kvcache.block_key import encode_tokens
from kvyard.kvcache.segment_key import window_hash, window_hashes


@dataclass(frozen=True, slots=True)
class SegmentSource:
    """A cached full block: where its tokens were computed and under which namespace root."""

    block_id: int
    start: int
    root: bytes
    tokens: bytes  # encode_tokens of its block_size tokens


@dataclass(frozen=True, slots=True)
class SegmentMatch:
    """`block_size` prompt tokens from `new_start` whose keys and values a cached block holds, computed at
    `old_start` (after other tokens)."""

    new_start: int
    block_id: int
    old_start: int

    @property
    def offset(self) -> int:
        return self.new_start - self.old_start


class SegmentIndex:
    """Cached full blocks by their tokens. The owner adds a block when its keys and values are complete and drops
    it before the block is reused for other tokens."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, not {block_size}")
        self.block_size = block_size
        self._by_hash: dict[int, list[SegmentSource]] = {}
        self._hash_of_block: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._hash_of_block)

    def add(self, block_id: int, start: int, tokens: Sequence[int], root: bytes, rolling: int | None = None) -> None:
        """Index `block_id`, holding `tokens` (exactly block_size of them) computed from position `start`;
        `rolling`: their `window_hash`, when the caller has it already."""
        if len(tokens) != self.block_size:
            raise ValueError(f"a segment holds {self.block_size} tokens, not {len(tokens)}")
        self.discard(block_id)
        if rolling is None:
            rolling = window_hash(tokens)
        self._by_hash.setdefault(rolling, []).append(SegmentSource(block_id, start, root, encode_tokens(list(tokens))))
        self._hash_of_block[block_id] = rolling

    def discard(self, block_id: int) -> None:
        rolling = self._hash_of_block.pop(block_id, None)
        if rolling is None:
            return
        sources = [source for source in self._by_hash[rolling] if source.block_id != block_id]
        if sources:
            self._by_hash[rolling] = sources
        else:
            del self._by_hash[rolling]

    def find(self, prompt: Sequence[int], start: int, root: bytes, end: int | None = None) -> list[SegmentMatch]:
        """Non-overlapping matches for prompt[start:end], left to right, taking the first match at each offset.
        Where several blocks hold the same tokens, the one continuing the previous match's shift is preferred
        (the text moved as a whole), then the first indexed."""
        end = len(prompt) if end is None else end
        size = self.block_size
        if end - start < size or not self._by_hash:
            return []
        hashes = window_hashes(prompt[start:end], size)
        known = np.fromiter(self._by_hash, dtype=np.uint64, count=len(self._by_hash))
        candidates = np.flatnonzero(np.isin(hashes, known))
        matches: list[SegmentMatch] = []
        next_free = 0
        for index in candidates.tolist():
            if index < next_free:
                continue
            position = start + index
            tokens = encode_tokens(list(prompt[position : position + size]))
            sources = [s for s in self._by_hash[int(hashes[index])] if s.root == root and s.tokens == tokens]
            if not sources:
                continue
            shift = matches[-1].offset if matches else None
            source = next((s for s in sources if position - s.start == shift), sources[0])
            matches.append(SegmentMatch(position, source.block_id, source.start))
            next_free = index + size
        return matches


def runs_of(matches: Sequence[SegmentMatch], block_size: int) -> list[tuple[int, int]]:
    """(first position, length) of each stretch of adjacent matches with one shift: text that moved together."""
    runs: list[tuple[int, int]] = []
    for previous, match in zip([None, *matches], matches):
        adjacent = previous is not None and previous.new_start + block_size == match.new_start
        if adjacent and previous is not None and previous.offset == match.offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + block_size)
        else:
            runs.append((match.new_start, block_size))
    return runs

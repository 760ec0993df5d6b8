"""Which moved text one replica could blend into a prompt: the segment fingerprints (kvcache.segment_key) of the
blocks in its device cache, as its KV events announce them (a replica that blends, kvyard.engine.blend).

A prompt whose cached prefix ends can still reuse blocks of its text computed at other positions. The router
fingerprints the prompt's window at every offset once per decision, and for each replica counts the tokens in
windows the replica holds after the prefix it holds, left to right without overlap, as the replica's own search
does (kvyard.engine.blend.segments). Fingerprints screen only: the replica compares tokens before it reuses one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SegmentHolds:
    counts: dict[int, int] = field(default_factory=dict)  # fingerprint -> blocks holding it
    of_key: dict[bytes, int] = field(default_factory=dict)  # block key -> its fingerprint

    def reset(self, fingerprints: dict[bytes, int]) -> None:
        self.clear()
        self.stored(list(fingerprints), list(fingerprints.values()))

    def stored(self, keys: Sequence[bytes], fingerprints: Sequence[int]) -> None:
        counts, of_key = self.counts, self.of_key
        for key, fingerprint in zip(keys, fingerprints):
            if key not in of_key:
                of_key[key] = fingerprint
                counts[fingerprint] = counts.get(fingerprint, 0) + 1

    def removed(self, keys: Iterable[bytes]) -> None:
        counts, of_key = self.counts, self.of_key
        for key in keys:
            fingerprint = of_key.pop(key, None)
            if fingerprint is None:
                continue
            left = counts[fingerprint] - 1
            if left:
                counts[fingerprint] = left
            else:
                del counts[fingerprint]

    def clear(self) -> None:
        self.counts.clear()
        self.of_key.clear()

    def matched_tokens(self, windows: PromptWindows, start: int) -> int:
        """Prompt tokens from `start` on in windows this replica holds, taken left to right without overlap."""
        if not self.counts or start >= windows.last_start:
            return 0
        common = windows.distinct & self.counts.keys()
        if not common:
            return 0
        held = np.fromiter(common, dtype=np.uint64, count=len(common))
        size, matched, next_free = windows.block_size, 0, start
        for position in (start + np.flatnonzero(np.isin(windows.fingerprints[start:], held))).tolist():
            if position >= next_free:
                matched += size
                next_free = position + size
        return matched


@dataclass(frozen=True, slots=True)
class PromptWindows:
    """One prompt's window fingerprints under one namespace root (kvcache.segment_key.prompt_fingerprints)."""

    fingerprints: np.ndarray  # uint64, one per window start
    distinct: frozenset[int]
    block_size: int

    @classmethod
    def of(cls, fingerprints: np.ndarray, block_size: int) -> PromptWindows:
        return cls(fingerprints, frozenset(fingerprints.tolist()), block_size)

    @property
    def last_start(self) -> int:
        return len(self.fingerprints)

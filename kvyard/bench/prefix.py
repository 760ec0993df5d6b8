"""The ideal prefix reuse of a workload: what an unlimited prefix cache could have served."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixTracker:
    """Chained keys of every full block sent so far; a prompt's ideal hit is its leading run of known blocks.

    Python's hash of a tuple of ints is the same in every process, and a 64-bit collision between two
    different prefixes of one benchmark is negligible, so no cryptographic hash is needed here.
    """

    block_size: int
    seen: set[int] = field(default_factory=set)

    def observe(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` an unlimited cache already holds; then remember all of its full blocks."""
        parent, hit_blocks, still_hitting = 0, 0, True
        for begin in range(0, len(prompt) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(prompt[begin : begin + self.block_size])))
            if still_hitting and parent in self.seen:
                hit_blocks += 1
            else:
                still_hitting = False
                self.seen.add(parent)
        return hit_blocks * self.block_size


def ideal_block_hit_ratio(block_ids: Iterable[Sequence[int]]) -> float | None:
    """Share of blocks whose id an earlier request already had (a trace's prefix-hash ids, unlimited cache)."""
    seen: set[int] = set()
    hits = total = 0
    for ids in block_ids:
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        hits += leading
        total += len(ids)
        seen.update(ids)
    return hits / total if total else None

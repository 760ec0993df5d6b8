"""What the connector's tiers hold, as vLLM's scheduler can know it without loading a byte.

The scheduler decides how many tokens a request gets from the tier before any block moves, and it may run in
another process than the worker that owns the tier. So it keeps three views: the keys the worker reports its own
tiers gained and lost (memory and disk, from the tier's KV events), the disk tier's files (blocks written before a
restart, which no event announced), and the shared store, asked directly (EXISTS). Blocks a step saves count as held
at once: the worker's report of them rides on a later step, which may not come before the next request asks. A
block claimed here and gone by the time the worker loads it is reported by the worker as a load error, and vLLM
computes it instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from kvyard.kvcache.config import KVTierConfig, default_disk_dir
from kvyard.kvcache.disk_tier import block_path
from kvyard.kvcache.redis_tier import RedisTier

Source = Literal["memory", "disk", "redis"]


class TierPresence:
    def __init__(self, config: KVTierConfig, shared: RedisTier | None = None) -> None:
        tiers = config.active_tiers
        self._local: set[bytes] = set()
        self._has_local = "memory" in tiers or "disk" in tiers
        self._local_source: Source = "memory" if "memory" in tiers else "disk"
        self._disk_dir: Path | None = Path(config.disk_dir or default_disk_dir()) if "disk" in tiers else None
        self._shared = shared

    def apply(self, stored: Iterable[bytes], removed: Iterable[bytes], snapshot: bool = False) -> None:
        """The worker's report: keys its own tiers gained and lost (`snapshot`: `stored` is all they hold)."""
        if snapshot:
            self._local.clear()
        self._local.update(stored)
        self._local.difference_update(removed)

    def expect(self, keys: Iterable[bytes]) -> None:
        """Blocks the worker is saving: counted as held by its own tiers from now (the worker waits for a write that
        a load needs, and reports a block it did not find, which is forgotten then). Without tiers of its own, the
        shared store is asked instead: counting them would offer, after a flush or an eviction there, blocks that
        no tier holds, each a failed load vLLM computes again."""
        if self._has_local:
            self._local.update(keys)

    def held_locally(self, key: bytes) -> bool:
        return key in self._local

    def leading(self, keys: Sequence[bytes]) -> list[Source]:
        """Where each of the leading `keys` the tiers hold would come from, up to the first one none holds."""
        sources: list[Source] = []
        for key in keys:
            if key in self._local:
                sources.append(self._local_source)
            elif self._disk_dir is not None and block_path(self._disk_dir, key).exists():
                sources.append("disk")
            else:
                break
        rest = keys[len(sources) :]
        if rest and self._shared is not None:
            sources.extend(["redis"] * self._shared.leading_held(rest))
        return sources

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()

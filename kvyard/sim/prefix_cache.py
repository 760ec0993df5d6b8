"""A bounded prefix cache of KV blocks with reference counts and LRU eviction, but no KV bytes.

It does the engine block pool's accounting: a running request holds one block per `block_size`
tokens; a full, computed block is registered under its chained block key and stays findable after
its last reference is dropped, until the space is needed (least recently freed first). Registering
and evicting record `stored` / `removed` KV events, so a consumer sees exactly this cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvyard.kvcache.events import KVEventLog

# A request's block table: the key of each registered block, None for a block not (yet) registered.
BlockTable = list[bytes | None]


@dataclass(slots=True)
class PrefixCache:
    capacity_blocks: int
    events: KVEventLog = field(default_factory=KVEventLog)
    _ref_counts: dict[bytes, int] = field(init=False, default_factory=dict)
    _evictable: OrderedDict[bytes, None] = field(init=False, default_factory=OrderedDict)
    _num_unregistered: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.capacity_blocks < 1:
            raise ValueError(f"cache capacity must be at least one block, got {self.capacity_blocks}")

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by requests (what the engine reports as used)."""
        return self._num_unregistered + len(self._ref_counts) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, evicting unreferenced cached blocks if needed."""
        return self.capacity_blocks - self.num_used_blocks

    def cached_keys(self) -> list[bytes]:
        return list(self._ref_counts)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ref_counts

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are cached."""
        for index, key in enumerate(keys):
            if key not in self._ref_counts:
                return index
        return len(keys)

    def acquire(self, table: BlockTable, cached: Sequence[bytes], num_new: int) -> bool:
        """Append `cached` (found by `match`) and `num_new` fresh blocks to `table`, or change nothing
        and return False when the capacity cannot hold them."""
        num_revived = sum(1 for key in cached if key in self._evictable) if cached else 0
        if num_new + num_revived > self.num_free_blocks:
            return False
        for key in cached:
            if self._ref_counts[key] == 0:
                del self._evictable[key]
            self._ref_counts[key] += 1
        self._make_room(num_new)
        self._num_unregistered += num_new
        table.extend(cached)
        table.extend([None] * num_new)
        return True

    def register(self, table: BlockTable, index: int, key: bytes) -> bool:
        """Make the computed block `table[index]` findable under `key`. False if another block holds it."""
        if table[index] is not None:
            raise ValueError(f"block {index} of this request is already registered")
        if key in self._ref_counts:
            return False
        self._ref_counts[key] = 1
        self._num_unregistered -= 1
        table[index] = key
        return True

    def release(self, table: BlockTable) -> None:
        """Drop a request's blocks, its tail first, so the tail is evicted before the shared prefix."""
        for key in reversed(table):
            if key is None:
                self._num_unregistered -= 1
                continue
            count = self._ref_counts[key] - 1
            self._ref_counts[key] = count
            if count == 0:
                self._evictable[key] = None
        table.clear()

    def record_stored(self, keys: Iterable[bytes]) -> None:
        self.events.record("stored", list(keys))

    def _make_room(self, num_blocks: int) -> None:
        shortfall = num_blocks - (self.capacity_blocks - self._num_unregistered - len(self._ref_counts))
        evicted = []
        for _ in range(max(0, shortfall)):
            key, _ = self._evictable.popitem(last=False)
            del self._ref_counts[key]
            evicted.append(key)
        self.events.record("removed", evicted)

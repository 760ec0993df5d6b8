"""Physical KV blocks: reference counts, the prefix-cache map, and LRU eviction.

A block with reference count 0 sits in the free queue. If it also holds a registered block key it
stays findable in the prefix cache until it is reused for something else (evicted). The free queue
is ordered by eviction preference: blocks without a key first, then cached blocks least recently
freed first. Every call that stores or evicts keys records them as one KV event.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvyard.kvcache.events import EventKind, KVEventLog


class BlockPoolError(RuntimeError):
    """An internal accounting error (double free, over-allocation): a bug, never user input."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[bytes | None] = [None] * num_blocks
        self._fingerprints: dict[int, int] = {}  # block -> segment fingerprint, for blocks registered with one
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.on_evict: Callable[[int], None] | None = None  # told each cached block about to hold other tokens

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_block_keys(self) -> list[bytes]:
        return list(self._cached)

    def lookup(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockPoolError(f"asked for {count} blocks with {len(self._free)} free")
        blocks, evicted = [], []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            key = self._evict(block_id)
            if key is not None:
                evicted.append(key)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        self._record("removed", evicted)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order; the first freed is the first evicted."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise BlockPoolError(f"block {block_id} freed with reference count {count}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None
                if self._block_keys[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def register(self, block_id: int, key: bytes) -> bool:
        """Make a full, computed block findable by its key. False if another block holds the key."""
        return bool(self.register_blocks([block_id], [key]))

    def register_blocks(
        self, block_ids: Sequence[int], keys: Sequence[bytes], fingerprints: Sequence[int] | None = None
    ) -> list[tuple[int, bytes]]:
        """`register` each (block, key) pair; returns the pairs newly registered, recorded as one event.
        `fingerprints`: each block's segment fingerprint (kvcache.segment_key), announced with its key."""
        if not self.enable_caching:
            return []
        registered: list[tuple[int, bytes]] = []
        announced: list[int] = []
        for index, (block_id, key) in enumerate(zip(block_ids, keys)):
            if key in self._cached:
                continue
            if self._block_keys[block_id] is not None:
                raise BlockPoolError(f"block {block_id} registered twice")
            self._cached[key] = block_id
            self._block_keys[block_id] = key
            registered.append((block_id, key))
            if fingerprints is not None:
                self._fingerprints[block_id] = fingerprints[index]
                announced.append(fingerprints[index])
        if self.events is not None and registered:
            self.events.record("stored", [key for _, key in registered], segments=announced)
        return registered

    def cached_fingerprints(self) -> dict[bytes, int]:
        """The segment fingerprint of every cached block registered with one, by its key (for snapshots)."""
        keys = self._block_keys
        return {key: fingerprint for block_id, fingerprint in self._fingerprints.items() if (key := keys[block_id])}

    def reset_prefix_cache(self) -> None:
        self._record("removed", [key for key in map(self._evict, list(self._cached.values())) if key is not None])

    def _evict(self, block_id: int) -> bytes | None:
        """Forget the block's key (its KV is about to be overwritten); returns the key it held."""
        key = self._block_keys[block_id]
        if key is not None:
            self._block_keys[block_id] = None
            del self._cached[key]
            self._fingerprints.pop(block_id, None)
            if self.on_evict is not None:
                self.on_evict(block_id)
        return key

    def _record(self, kind: EventKind, keys: list[bytes]) -> None:
        if self.events is not None and keys:
            self.events.record(kind, keys)

    def check_invariants(self) -> None:
        """Raise if the accounting is inconsistent (used by tests)."""
        free = set(self._free)
        for block_id, count in enumerate(self._ref_counts):
            if count < 0 or (count == 0) != (block_id in free):
                raise BlockPoolError(f"block {block_id}: ref count {count}, in free queue {block_id in free}")
        for key, block_id in self._cached.items():
            if self._block_keys[block_id] != key:
                raise BlockPoolError(f"cache map and block {block_id} disagree on its key")
        if sum(k is not None for k in self._block_keys) != len(self._cached):
            raise BlockPoolError("a block holds a key that the cache map does not")

"""What the shared KV store holds, as far as the router knows (docs/contracts.md §7).

Every replica publishes `shared` events for the blocks it wrote to the shared store and for those it saw leave
it; the router keeps one index per store, named by the store's id, which changes when the store is flushed or
restarted (a replica that notices says `cleared`, and the index of the old id is dropped). Entries expire with
the store's TTL. What no replica can see (an eviction by the store's own memory policy) is learned from what
replicas report: a request that loaded fewer shared blocks than predicted removes the ones it did not find
(`forget_after`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

# Beyond this many keys, the least recently used are forgotten (a miss predicted, never a wrong hit).
MAX_KEYS_PER_STORE = 1 << 22


@dataclass(slots=True)
class SharedStoreIndex:
    ttl_s: float | None = None
    max_keys: int = MAX_KEYS_PER_STORE
    _expires: dict[bytes, float] = field(default_factory=dict)  # key -> time.monotonic() it expires, oldest first

    def stored(self, keys: Iterable[bytes], now: float) -> None:
        expires = now + self.ttl_s if self.ttl_s is not None else math.inf
        entries = self._expires
        for key in keys:
            entries.pop(key, None)
            entries[key] = expires
        if len(entries) > self.max_keys:
            self._forget_oldest(len(entries) - self.max_keys + self.max_keys // 16)

    def _forget_oldest(self, count: int) -> None:
        """Forget the `count` oldest entries at once. A dict reaches its first entry by skipping the slots of
        the entries deleted before it, so forgetting one entry per insert would cost a scan of those per insert."""
        oldest = list(islice(self._expires, count))
        for key in oldest:
            del self._expires[key]

    def used(self, keys: Sequence[bytes]) -> None:
        """A request will read the leading `keys` it holds: they become the newest entries, the last the cap
        forgets. Without this the cap forgets by age of writing, so a long conversation's first blocks, written
        once and read every turn, were the first forgotten, and every later turn looked like a recompute anywhere
        but on its last replica."""
        entries = self._expires
        for key in keys:
            expires = entries.pop(key, None)
            if expires is None:
                break
            entries[key] = expires

    def removed(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._expires.pop(key, None)

    def holds(self, key: bytes, now: float) -> bool:
        expires = self._expires.get(key)
        if expires is None:
            return False
        if expires < now:
            del self._expires[key]
            return False
        return True

    def __len__(self) -> int:
        return len(self._expires)


@dataclass(slots=True)
class SharedStores:
    """The indexes of every shared store the fleet's replicas use, by store id."""

    stores: dict[str, SharedStoreIndex] = field(default_factory=dict)
    max_keys: int = MAX_KEYS_PER_STORE  # per store

    def get(self, store_id: str | None) -> SharedStoreIndex | None:
        return self.stores.get(store_id) if store_id is not None else None

    def joined(self, store_id: str, ttl_s: float | None) -> SharedStoreIndex:
        """A replica uses the store `store_id` (from its snapshot)."""
        index = self.stores.get(store_id)
        if index is None:
            index = self.stores[store_id] = SharedStoreIndex(ttl_s, self.max_keys)
        elif ttl_s is not None:
            index.ttl_s = ttl_s
        return index

    def cleared(self, previous_id: str | None, store_id: str) -> SharedStoreIndex:
        """A replica's store is now `store_id`; whatever `previous_id` held is gone."""
        if previous_id is not None and previous_id != store_id:
            old = self.stores.pop(previous_id, None)
            ttl_s = old.ttl_s if old is not None else None
        else:
            ttl_s = None
        index = self.stores.get(store_id)
        if index is None:
            index = self.stores[store_id] = SharedStoreIndex(ttl_s, self.max_keys)
        return index

    def record(self, store_id: str | None, kind: str, keys: Iterable[bytes]) -> None:
        """A replica using `store_id` wrote `keys` to it (kind "stored") or saw them leave ("removed"); nothing is
        filed while the replica's store is unknown (it wrote before it learned the store's id)."""
        index = self.get(store_id)
        if index is None:
            return
        if kind == "stored":
            index.stored(keys, time.monotonic())
        else:
            index.removed(keys)

    def forget_after(self, store_id: str | None, keys: Sequence[bytes]) -> None:
        index = self.get(store_id)
        if index is not None:
            index.removed(keys)

    @property
    def num_blocks(self) -> int:
        return sum(len(index) for index in self.stores.values())

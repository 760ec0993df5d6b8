"""What one replica holds in its prefix cache, as far as the router knows.

Two sources, kept apart so each can be replaced without touching the other:
- `exact`: the block keys the replica announced in its KV-event stream (None while the replica publishes
  no events, or has not been synced yet);
- `routed`: keys of prompts the router sent there. For a replica without events this is the only source
  (an approximate LRU index of bounded size). For a replica with events these entries only bridge the
  time until the replica's own `stored` event arrives: they do not expire while the request that put
  them there waits for its first token (however long its queue), and expire `routed_ttl_s` after it.
  This keeps a burst of sibling requests, or the next turn of a conversation whose last turn is still
  queued, from being routed on a stale index.

A routed entry names the request (its batch) that put it there, and the batch carries the time: when a request's
first byte arrives, its thousands of entries start their time-to-live by one assignment, not one each.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvyard.router.holders import KeyHolders
from kvyard.router.segment_holds import SegmentHolds


@dataclass(slots=True)
class CacheIndex:
    routed_capacity: int = 1 << 18
    routed_ttl_s: float = 5.0
    # Key sets are dicts with None values: the garbage collector stops walking a dict of untracked keys and
    # values (it walks every set, and a router holds millions of keys).
    exact: dict[bytes, None] | None = None
    seq: int = 0
    routed: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # key -> the batch that routed it last
    local: dict[bytes, None] = field(default_factory=dict)
    # The fleet-wide inverted index this one keeps current, and who it names as the holder (its replica).
    holders: KeyHolders | None = None
    owner: Any = None
    segments: SegmentHolds = field(default_factory=SegmentHolds)  # device blocks by their own tokens (blending)
    # Batch -> its time (math.inf while its request waits for a first byte), oldest batch first. Integers, not
    # objects, as the routed map's values: the collector does not walk a map of untracked keys and values.
    _stamps: OrderedDict[int, float] = field(default_factory=OrderedDict)
    _next_batch: int = 0

    @property
    def has_events(self) -> bool:
        return self.exact is not None

    def holds(self, key: bytes, now: float) -> bool:
        if self.exact is not None and key in self.exact:
            return True
        batch = self.routed.get(key)
        if batch is None:
            return False
        if self.exact is not None and now - self._stamps.get(batch, -math.inf) > self.routed_ttl_s:
            del self.routed[key]
            self._release(key)
            return False
        return True

    def note_routed(self, keys: Iterable[bytes], now: float | None = None) -> int:
        """Record keys of a prompt routed here, as one batch (returned); `now=math.inf` keeps them until the
        batch is stamped (`stamp`)."""
        stamp = time.monotonic() if now is None else now
        batch = self._next_batch
        self._next_batch += 1
        self._stamps[batch] = stamp
        self._forget_expired_batches(time.monotonic() if stamp == math.inf else stamp)
        routed, fresh = self.routed, []
        for key in keys:
            if routed.pop(key, None) is None:  # popped and put back: the most recently routed go last
                fresh.append(key)
            routed[key] = batch
        if self.holders is not None:
            self.holders.add_all(fresh, self.owner)
        while len(routed) > self.routed_capacity:
            self._release(routed.popitem(last=False)[0])
        return batch

    def stamp(self, batch: int, now: float | None = None) -> None:
        """The request of `batch` got its first byte: its entries' time-to-live starts."""
        if batch in self._stamps:
            self._stamps[batch] = time.monotonic() if now is None else now

    def _forget_expired_batches(self, now: float) -> None:
        """Drop the times of the oldest batches once expired (their entries then read as expired)."""
        stamps, limit = self._stamps, now - self.routed_ttl_s
        while len(stamps) > 1:
            batch, stamp = next(iter(stamps.items()))
            if stamp >= limit:  # a batch still waiting for its first byte (inf) keeps the later ones too
                return
            del stamps[batch]

    # ------------------------------------------------------------------ the replica's own account

    def reset(
        self,
        keys: Iterable[bytes],
        seq: int,
        local_keys: Iterable[bytes] = (),
        segments: dict[bytes, int] | None = None,
    ) -> None:
        """Replace everything by a snapshot: stale entries (a restart, lost events) disappear here."""
        self._release_all()
        self.segments.reset(segments or {})
        self.exact = dict.fromkeys(keys)
        self.local = dict.fromkeys(local_keys)
        self.seq = seq
        self.routed.clear()
        self._stamps.clear()
        self._hold(self.exact)
        self._hold(self.local)

    def apply(
        self, seq: int, kind: str, keys: Iterable[bytes], medium: str = "device", segments: Sequence[int] | None = None
    ) -> None:
        """One event about the device cache or the local tiers (shared events go to the store's index);
        `segments`: the stored device blocks' segment fingerprints, from a replica that blends."""
        assert self.exact is not None, "apply() before reset()"
        target = self.local if medium == "local" else self.exact
        if kind == "stored":
            keys = list(keys)
            target.update(dict.fromkeys(keys))
            self._hold(keys)
            if segments is not None and medium == "device":
                self.segments.stored(keys, segments)
        elif kind == "removed":
            keys = list(keys)
            for key in keys:
                target.pop(key, None)
            if medium == "device":
                self._forget_computed(keys)
                self.segments.removed(keys)
            for key in keys:
                self._release(key)
        self.seq = seq

    def _forget_computed(self, keys: list[bytes]) -> None:
        """Routed entries of requests past their first token bridge nothing once the replica evicts the block (a
        request still waiting keeps its entry: it will compute the block again)."""
        routed, stamps = self.routed, self._stamps
        for key in keys:
            batch = routed.get(key)
            if batch is not None and stamps.get(batch) != math.inf:
                del routed[key]

    def clear(self) -> None:
        """Nothing is known any more (the replica may be restarting); the sequence number is kept."""
        self._release_all()
        self.segments.clear()
        if self.exact is not None:
            self.exact.clear()
        self.routed.clear()
        self._stamps.clear()
        self.local.clear()

    def forget_events(self) -> None:
        """The replica stopped publishing (or is gone): keep nothing we can no longer keep current."""
        self._release_all()
        self.segments.clear()
        self.exact = None
        self.routed.clear()
        self._stamps.clear()
        self.local.clear()

    def holds_anywhere(self, key: bytes) -> bool:
        """In the device cache, the own tiers or the routed entries (expired ones included)."""
        return (self.exact is not None and key in self.exact) or key in self.routed or key in self.local

    def _hold(self, keys: Iterable[bytes]) -> None:
        if self.holders is not None:
            self.holders.add_all(keys, self.owner)

    def _release(self, key: bytes) -> None:
        """`key` left one of the sources: the fleet index forgets this holder once it is in none."""
        if self.holders is not None and not self.holds_anywhere(key):
            self.holders.discard(key, self.owner)

    def _release_all(self) -> None:
        holders = self.holders
        if holders is None:
            return
        for source in (self.exact or (), self.routed, self.local):
            for key in source:
                holders.discard(key, self.owner)

    @property
    def num_blocks(self) -> int:
        return len(self.exact) if self.exact is not None else len(self.routed)

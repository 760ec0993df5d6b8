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
    routed: OrderedDict[bytes, float] = field(default_factory=OrderedDict)
    local: dict[bytes, None] = field(default_factory=dict)
    # The fleet-wide inverted index this one keeps current, and who it names as the holder (its replica).
    holders: KeyHolders | None = None
    owner: Any = None
    segments: SegmentHolds = field(default_factory=SegmentHolds)  # device blocks by their own tokens (blending)

    @property
    def has_events(self) -> bool:
        return self.exact is not None

    def holds(self, key: bytes, now: float) -> bool:
        if self.exact is not None and key in self.exact:
            return True
        stamp = self.routed.get(key)
        if stamp is None:
            return False
        if self.exact is not None and now - stamp > self.routed_ttl_s:
            del self.routed[key]
            self._release(key)
            return False
        return True

    def note_routed(self, keys: Iterable[bytes], now: float | None = None) -> None:
        """Record keys of a prompt routed here; `now=math.inf` keeps them until noted again with a time."""
        stamp = time.monotonic() if now is None else now
        routed, holders = self.routed, self.holders
        for key in keys:
            routed[key] = stamp
            routed.move_to_end(key)
            if holders is not None:
                holders.add(key, self.owner)
        while len(routed) > self.routed_capacity:
            self._release(routed.popitem(last=False)[0])

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
        routed = self.routed
        for key in keys:
            stamp = routed.get(key)
            if stamp is not None and stamp != math.inf:
                del routed[key]

    def clear(self) -> None:
        """Nothing is known any more (the replica may be restarting); the sequence number is kept."""
        self._release_all()
        self.segments.clear()
        if self.exact is not None:
            self.exact.clear()
        self.routed.clear()
        self.local.clear()

    def forget_events(self) -> None:
        """The replica stopped publishing (or is gone): keep nothing we can no longer keep current."""
        self._release_all()
        self.segments.clear()
        self.exact = None
        self.routed.clear()
        self.local.clear()

    def holds_anywhere(self, key: bytes) -> bool:
        """In the device cache, the own tiers or the routed entries (expired ones included)."""
        return (self.exact is not None and key in self.exact) or key in self.routed or key in self.local

    def _hold(self, keys: Iterable[bytes]) -> None:
        holders = self.holders
        if holders is not None:
            for key in keys:
                holders.add(key, self.owner)

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

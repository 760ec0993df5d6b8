"""KV events (docs/contracts.md §3 and §7): `stored` / `removed` block keys with gap-free sequence numbers.

Each event names the medium it is about: `device` (the replica's prefix cache), `local` (its own lower tiers:
host memory and disk; a key is `stored` when the first of them holds it and `removed` when the last one drops it)
or `shared` (the store every replica of the fleet reads, e.g. Redis: `stored` for what this replica wrote there,
`removed` for what it saw evicted or discarded). `cleared` (shared only, no keys) says the shared store this
replica uses is now the one named `store`, and that whatever was known of the store it used before is gone
(it was flushed or restarted, or the replica reached it for the first time).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

EventKind = Literal["stored", "removed", "cleared"]
Medium = Literal["device", "local", "shared"]
MEDIA: tuple[Medium, ...] = ("device", "local", "shared")


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int
    kind: EventKind
    block_keys: tuple[bytes, ...]
    timestamp: float
    medium: Medium = "device"
    store: str | None = None  # the shared store's id (`cleared` events)
    segments: tuple[int, ...] = ()  # device `stored`: each block's segment fingerprint (kvcache.segment_key), if any


@dataclass(slots=True)
class KVEventLog:
    """A bounded, thread-safe log of KV events. Readers poll with the last sequence they saw.

    When a reader falls behind the retained window, `events_since` says so (`complete=False`) and
    the reader must resync from a snapshot of the cache instead of guessing.
    """

    capacity: int = 65536
    _events: deque[KVEvent] = field(init=False)
    _next_seq: int = field(init=False, default=1)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._events = deque(maxlen=self.capacity)

    def record(
        self, kind: EventKind, block_keys: list[bytes], medium: Medium = "device", segments: Sequence[int] = ()
    ) -> None:
        """`segments`: for device `stored` events of a replica that indexes them, each block's fingerprint."""
        if not block_keys:
            return
        self._append(kind, tuple(block_keys), medium, None, tuple(segments))

    def record_cleared(self, store: str) -> None:
        """The replica's shared store is now `store`, and what it held before is not there (any more)."""
        self._append("cleared", (), "shared", store)

    def _append(
        self,
        kind: EventKind,
        block_keys: tuple[bytes, ...],
        medium: Medium,
        store: str | None,
        segments: tuple[int, ...] = (),
    ) -> None:
        with self._lock:
            self._events.append(KVEvent(self._next_seq, kind, block_keys, time.time(), medium, store, segments))
            self._next_seq += 1

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._next_seq - 1

    def events_since(self, seq: int) -> tuple[list[KVEvent], bool]:
        """Events with sequence number > seq, and whether none in between were dropped. A `seq` beyond the last
        event is not complete either: the reader knows a log this one is not (it restarted), so it resyncs."""
        with self._lock:
            if seq > self._next_seq - 1:
                return [], False
            if not self._events:
                return [], seq == self._next_seq - 1
            complete = seq >= self._events[0].seq - 1
            # The newest `count` events, read from the right: a copy of the whole deque, on every poll of every
            # event stream, cost 379 us once the log was full.
            count = self._next_seq - 1 - seq
            newest = list(islice(reversed(self._events), count))
            newest.reverse()
            return newest, complete

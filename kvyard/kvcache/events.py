"""KV events (DESIGN.md, contract 3): `stored` / `removed` block keys with gap-free sequence numbers."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

EventKind = Literal["stored", "removed"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int
    kind: EventKind
    block_keys: tuple[bytes, ...]
    timestamp: float


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

    def record(self, kind: EventKind, block_keys: list[bytes]) -> None:
        if not block_keys:
            return
        with self._lock:
            self._events.append(KVEvent(self._next_seq, kind, tuple(block_keys), time.time()))
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
            first = self._events[0].seq
            complete = seq >= first - 1
            start = max(0, seq + 1 - first)
            return list(self._events)[start:], complete

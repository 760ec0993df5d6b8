"""Counters of the KV tier, as plain data; the server exports them to Prometheus."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class TierCounters:
    hits: int = 0  # blocks served
    misses: int = 0  # lookups that ended in this tier with the wanted prefix incomplete
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    stores: int = 0
    store_seconds: float = 0.0
    corrupt: int = 0  # blocks dropped because the bytes were damaged
    mismatched: int = 0  # blocks dropped because they belong to another namespace/layout
    errors: int = 0  # failed operations (I/O error, connection refused, timeout)
    evictions: int = 0


@dataclass(slots=True)
class TierStats:
    """Thread-safe counters of one tier."""

    _counters: TierCounters = field(default_factory=TierCounters)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self._counters, name, getattr(self._counters, name) + amount)

    def snapshot(self) -> TierCounters:
        with self._lock:
            return TierCounters(**{f.name: getattr(self._counters, f.name) for f in fields(TierCounters)})


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    tiers: dict[str, TierCounters]
    queue_blocks: int
    queue_bytes: int
    queue_dropped_blocks: int
    loaded_blocks: int
    submitted_blocks: int

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


@dataclass(slots=True)
class RecentCost:
    """Recent seconds per unit (per loaded block, per prefill token) from cumulative totals read now and then: each
    reading that saw new work moves the estimate a fraction `weight` toward what that work cost; work that took
    time and brought nothing (a load that timed out) counts as one unit, so a stall raises the estimate."""

    weight: float = 0.3
    estimate: float | None = None
    _seconds: float = 0.0
    _units: float = 0.0

    def update(self, seconds: float, units: float) -> float | None:
        """Read the totals; returns the current estimate (None until some work was seen)."""
        new_seconds, new_units = seconds - self._seconds, units - self._units
        self._seconds, self._units = seconds, units
        if new_seconds > 0 or new_units > 0:
            sample = new_seconds / max(new_units, 1.0)
            self.estimate = sample if self.estimate is None else self.estimate + self.weight * (sample - self.estimate)
        return self.estimate

    def observe(self, seconds: float, units: float) -> None:
        """One piece of work, as it happens."""
        self.update(self._seconds + seconds, self._units + units)

"""What every storage tier offers the tiered store."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvyard.kvcache.codec import Blob
from kvyard.kvcache.stats import TierStats


@dataclass(slots=True)
class PutResult:
    """What one `put_many` changed: keys now held, and keys it evicted to make room."""

    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class LoadDeadline:
    """When a load gives up: at `at` (time.monotonic()), pushed back `extension_s_per_block` for every block it has
    brought so far. A load that brings blocks faster than computing them would take keeps going, however large; a
    stalled store brings none and stops on time."""

    at: float
    extension_s_per_block: float = 0.0
    loaded: int = 0

    @classmethod
    def of(cls, deadline: LoadDeadline | float) -> LoadDeadline:
        return deadline if isinstance(deadline, LoadDeadline) else cls(deadline)

    def passed(self) -> bool:
        return time.monotonic() > self.at + self.loaded * self.extension_s_per_block

    def count(self, blocks: int) -> None:
        self.loaded += blocks


class Tier(Protocol):
    name: str
    stats: TierStats
    shared: bool  # every replica reads it (Redis): its events say `shared`, the others' `local`
    ttl_s: float | None  # how long a stored block stays at most (None: until evicted)

    @property
    def store_id(self) -> str | None:
        """For a shared tier, the id of the store's current contents: it changes when the store is flushed or
        restarted (None: unknown yet, or not a shared tier)."""
        ...

    def get_prefix(self, keys: Sequence[bytes], deadline: LoadDeadline | float) -> Sequence[Blob]:
        """Blobs of the leading `keys` this tier holds, stopping at the first miss or once `deadline` has passed
        (a bare float: time.monotonic()); each block read counts toward the deadline's extension. Never raises
        for an unavailable backend: that is a miss."""
        ...

    def keys(self) -> list[bytes]:
        """Every key a local tier holds (for a snapshot); a shared tier answers []."""
        ...

    def contains(self, key: bytes) -> bool:
        """Cheap local check used to skip redundant writes; False when unknown."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> PutResult:
        """Store encoded blocks; failures are counted and logged, never raised."""
        ...

    def probe(self) -> None:
        """Look at the backend without moving blocks (a shared tier refreshes its store id and availability)."""
        ...

    def discard(self, key: bytes) -> None:
        """Remove a block found to be corrupt or mismatched."""
        ...

    def close(self) -> None: ...

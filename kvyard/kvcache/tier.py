"""What every storage tier offers the tiered store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvyard.kvcache.stats import TierStats


class Tier(Protocol):
    name: str
    stats: TierStats

    def get_prefix(self, keys: Sequence[bytes], deadline: float) -> list[bytes]:
        """Blobs of the leading `keys` this tier holds, stopping at the first miss or at `deadline`
        (time.monotonic()). Never raises for an unavailable backend: that is a miss."""
        ...

    def contains(self, key: bytes) -> bool:
        """Cheap local check used to skip redundant writes; False when unknown."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store encoded blocks; failures are counted and logged, never raised."""
        ...

    def discard(self, key: bytes) -> None:
        """Remove a block found to be corrupt or mismatched."""
        ...

    def close(self) -> None: ...

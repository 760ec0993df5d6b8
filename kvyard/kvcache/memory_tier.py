"""Host-memory tier: encoded blocks in an LRU map within a byte budget."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvyard.kvcache.codec import Blob
from kvyard.kvcache.stats import TierStats
from kvyard.kvcache.tier import LoadDeadline, PutResult


class MemoryTier:
    name = "memory"
    shared = False
    store_id: str | None = None
    ttl_s: float | None = None

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"memory tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._blobs: OrderedDict[bytes, Blob] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blobs)

    def get_prefix(self, keys: Sequence[bytes], deadline: LoadDeadline | float) -> Sequence[Blob]:
        start = time.perf_counter()
        found: list[Blob] = []
        with self._lock:
            for key in keys:
                blob = self._blobs.get(key)
                if blob is None:
                    break
                self._blobs.move_to_end(key)
                found.append(blob)
        if isinstance(deadline, LoadDeadline):  # memory answers at once; its blocks still extend a later tier's time
            deadline.count(len(found))
        self.stats.add(loads=1, load_seconds=time.perf_counter() - start, bytes_read=sum(map(len, found)))
        return found

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._blobs)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blobs

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> PutResult:
        start = time.perf_counter()
        result = PutResult()
        written = 0
        # A view (a frame) may be one row of a buffer holding a whole step's blocks: keeping the view would keep all
        # of them, whatever this tier's budget says. numpy copies without the interpreter lock, which the engine's
        # thread needs between its operators.
        owned = [(key, _owned(blob)) for key, blob in items if len(blob) <= self.capacity_bytes]
        with self._lock:
            for key, blob in owned:
                old = self._blobs.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                self._blobs[key] = blob
                self._bytes += len(blob)
                written += len(blob)
                result.stored.append(key)
                while self._bytes > self.capacity_bytes:
                    dropped_key, dropped = self._blobs.popitem(last=False)
                    self._bytes -= len(dropped)
                    result.evicted.append(dropped_key)
        self.stats.add(
            stores=1,
            store_seconds=time.perf_counter() - start,
            bytes_written=written,
            blocks_written=len(result.stored),
            evictions=len(result.evicted),
        )
        if result.evicted:
            gone = set(result.evicted)
            result.stored = [key for key in result.stored if key not in gone]
        return result

    def probe(self) -> None:
        pass

    def discard(self, key: bytes) -> None:
        with self._lock:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self._bytes -= len(blob)

    def close(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._bytes = 0


def _owned(blob: Blob) -> Blob:
    return np.frombuffer(blob, dtype=np.uint8).copy().data if isinstance(blob, memoryview) else blob

"""Connects the device KV cache to the persistent tier (kvyard.kvcache.TieredStore).

Reads run on a loader thread, one load at a time, each bounded by a deadline counted from its request;
the engine admits a request once its load is done (kv_cache_manager). Writes happen when prefill
(or decode) completes a block and it is registered in the prefix cache: the KV is copied out of the
device cache right there, on the engine thread, while the request still holds the block; encoding
and I/O run on the store's writer thread. Writing at completion rather than at eviction means a
block is on disk and in Redis even if it is never evicted (a server stopped with a warm cache, or a
second replica wanting the prefix now), at the cost of one host copy per new block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from kvyard.kvcache.codec import BlockFormat, DecodedBlock
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.tier import LoadDeadline
from kvyard.kvcache.tiered_store import BlockWrite, TieredStore


class TierDevice(Protocol):
    """The blocks the tier copies from and into: the device cache (kv_transfer.DeviceBlocks), or the simulator's
    stand-in."""

    @property
    def format(self) -> BlockFormat: ...

    def read(self, block_ids: Sequence[int]) -> Sequence[memoryview]: ...

    def write(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None: ...


class KVTierLink:
    """`load_min_speedup`: a load keeps going past `load_deadline_s` while it brings blocks at least this many times
    faster than the engine computes them (0: it stops at the deadline). A fixed deadline alone cuts the loads that
    save the most: a 100k-token history on a fast store takes longer than the deadline to load and far longer to
    recompute, while a stalled store brings nothing and still stops on time."""

    def __init__(
        self, store: TieredStore, device: TierDevice, load_deadline_s: float, load_min_speedup: float = 0.0
    ) -> None:
        self.store = store
        self.device = device
        self.format = device.format
        self.load_deadline_s = load_deadline_s
        self.load_min_speedup = load_min_speedup
        self.compute_s_per_block = 0.0
        # One thread: the store's tiers take one reader besides their writer; a stalled store then delays
        # other loads (each to its deadline) but never the engine's steps.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvyard-kv-loader")

    def start_fetch(self, root_key: bytes, keys: Sequence[bytes]) -> Future[Sequence[DecodedBlock]]:
        """Verified blocks for the longest prefix of `keys` the tiers return within the deadline, loaded on the
        loader thread."""
        deadline = LoadDeadline(time.monotonic() + self.load_deadline_s, self.extension_s_per_block)
        return self._loader.submit(self.store.load_prefix, root_key, keys, self.format, deadline)

    @property
    def extension_s_per_block(self) -> float:
        if self.load_min_speedup <= 0:
            return 0.0
        return self.compute_s_per_block / self.load_min_speedup

    def install(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None:
        """Copy fetched blocks into the device cache at `block_ids`."""
        self.device.write(block_ids, blocks)

    def offload(self, root_key: bytes, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Snapshot the blocks now (they may be reused right after) and queue them for the tiers."""
        if not block_ids:
            return
        rows = self.device.read(block_ids)
        self.store.submit([BlockWrite(root_key, key, self.format, payload=row) for key, row in zip(keys, rows)])

    # ------------------------------------------------------------ what the tiers hold and cost (docs/contracts.md §7)

    def publish_events(self, events: KVEventLog | None) -> None:
        self.store.events = events

    def local_keys(self) -> list[bytes]:
        return self.store.local_keys()

    def shared_store(self) -> tuple[str, float | None] | None:
        return self.store.shared_store()

    def shared_available(self) -> bool:
        return self.store.shared_available()

    def load_totals(self) -> dict[str, tuple[float, int]]:
        """Seconds spent loading and blocks served so far, by medium (`local`, `shared`)."""
        return self.store.load_totals()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self.store.close()

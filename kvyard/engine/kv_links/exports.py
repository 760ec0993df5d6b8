"""The prefill side of a transfer: leases that pin a request's blocks until a decode replica has pulled them.

A request prefilled for another replica (`KVTransferParams.export_id`) gets an `Export`. Each step, blocks it
has newly computed and registered are pinned (one reference each) and appended to the export, so a decode
replica can pull them while prefill still runs. When the request finishes the export is complete (or failed,
when it was aborted) and its lease starts: the blocks stay pinned until the decode replica releases the
transfer or `lease_s` passes, then they return to the prefix cache as ordinary cached, evictable blocks.
Whatever happens to the decode replica, nothing stays pinned longer than the lease. At most `max_pinned`
blocks are pinned at once; an export that would pass the cap fails at once (its decode replica computes
what it lacks) instead of starving the pool.

The engine thread changes exports; HTTP handlers read them (`view`, `is_pinned`) from other threads, so the
table is guarded by a lock. Pinned blocks are never written, which is what makes reading their KV off the
engine thread safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvyard.engine.scheduling.block_pool import BlockPool
from kvyard.engine.scheduling.request import Request
from kvyard.kvcache.codec import BlockFormat, encode_block
from kvyard.kvcache.pd_stream import TransferStatus

OPEN = "open"


@dataclass(slots=True)
class Export:
    transfer_id: str
    root_key: bytes
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    status: str = OPEN
    reason: str = ""
    num_cached_tokens: int = -1  # prompt tokens found in this replica's cache; -1 until the request is scheduled
    expires_at: float | None = None  # set when the request finishes


@dataclass(frozen=True, slots=True)
class ExportView:
    """Blocks of an export from some index on, and how the export stands, at one moment."""

    block_ids: list[int]
    block_keys: list[bytes]
    root_key: bytes
    status: str
    reason: str
    num_blocks: int
    num_cached_tokens: int


@dataclass(slots=True)
class ExportCounters:
    exports: int = 0
    blocks_exported: int = 0
    released: int = 0  # leases ended by the decode side's release
    expired: int = 0  # leases ended by time
    failed: int = 0  # exports whose request was aborted or hit the cap


class KVExports:
    def __init__(self, pool: BlockPool, lease_s: float, max_pinned: int) -> None:
        self.pool = pool
        self.lease_s = lease_s
        self.max_pinned = max_pinned
        self.counters = ExportCounters()
        self._exports: dict[str, Export] = {}
        self._by_request: dict[str, str] = {}
        self._num_pinned = 0
        self._lock = threading.Lock()

    @property
    def num_pinned_blocks(self) -> int:
        return self._num_pinned

    @property
    def num_active(self) -> int:
        return len(self._exports)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._exports

    def open(self, request: Request, transfer_id: str) -> None:
        if transfer_id in self._exports:
            raise ValueError(f"transfer id {transfer_id!r} is already in use")
        with self._lock:
            self._exports[transfer_id] = Export(transfer_id, request.cache_root_key)
            self._by_request[request.request_id] = transfer_id
            self.counters.exports += 1

    def offer(self, request: Request) -> None:
        """Pin the blocks `request` has registered since the last call (engine thread, after a step)."""
        export = self._export_of(request)
        if export is None or export.status != OPEN:
            return
        export.num_cached_tokens = request.num_cached_tokens
        start, end = len(export.block_ids), request.num_registered_blocks
        if end <= start:
            return
        if self._num_pinned + end - start > self.max_pinned:
            self._fail(export, "lease_cap")
            return
        new_blocks = request.block_table[start:end]
        self.pool.touch(new_blocks)
        with self._lock:
            export.block_ids.extend(new_blocks)
            export.block_keys.extend(request.block_keys[start:end])
            self._num_pinned += len(new_blocks)
        self.counters.blocks_exported += len(new_blocks)

    def finish(self, request: Request, completed: bool, now: float | None = None) -> None:
        """The request is done: its export is complete (the lease starts) or, when it was aborted, failed."""
        transfer_id = self._by_request.pop(request.request_id, None)
        export = self._exports.get(transfer_id) if transfer_id is not None else None
        if export is None or export.status != OPEN:
            return
        if not completed:
            self._fail(export, "aborted")
            return
        with self._lock:
            export.status = TransferStatus.COMPLETE
            export.expires_at = (time.monotonic() if now is None else now) + self.lease_s

    def release(self, transfer_id: str) -> bool:
        """The decode side has what it needs: unpin the blocks. False for an unknown (or expired) transfer."""
        export = self._exports.get(transfer_id)
        if export is None:
            return False
        self._drop(export)
        self.counters.released += 1
        return True

    def expire(self, now: float | None = None) -> int:
        """End the leases that have run out; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [e for e in self._exports.values() if e.expires_at is not None and e.expires_at <= now]
        for export in expired:
            self._drop(export)
        self.counters.expired += len(expired)
        return len(expired)

    def view(self, transfer_id: str, start: int) -> ExportView | None:
        """The export's blocks from index `start` on (any thread); None when there is no such transfer."""
        with self._lock:
            export = self._exports.get(transfer_id)
            if export is None:
                return None
            return ExportView(
                export.block_ids[start:],
                export.block_keys[start:],
                export.root_key,
                export.status,
                export.reason,
                len(export.block_ids),
                export.num_cached_tokens,
            )

    def is_pinned(self, transfer_id: str, num_blocks: int) -> bool:
        """The transfer still pins at least `num_blocks` blocks (any thread): a read of them was not raced."""
        with self._lock:
            export = self._exports.get(transfer_id)
            return export is not None and len(export.block_ids) >= num_blocks

    def _export_of(self, request: Request) -> Export | None:
        transfer_id = self._by_request.get(request.request_id)
        return self._exports.get(transfer_id) if transfer_id is not None else None

    def _fail(self, export: Export, reason: str) -> None:
        """Unpin at once; the export stays visible for a lease period so a puller learns why it ended."""
        self._unpin(export)
        with self._lock:
            export.status, export.reason = TransferStatus.FAILED, reason
            export.expires_at = time.monotonic() + self.lease_s
        self.counters.failed += 1

    def _drop(self, export: Export) -> None:
        self._unpin(export)
        with self._lock:
            self._exports.pop(export.transfer_id, None)
        for request_id, transfer_id in list(self._by_request.items()):
            if transfer_id == export.transfer_id:
                del self._by_request[request_id]

    def _unpin(self, export: Export) -> None:
        with self._lock:
            blocks, export.block_ids, export.block_keys = export.block_ids, [], []
            self._num_pinned -= len(blocks)
        self.pool.free(reversed(blocks))


class BlockReader(Protocol):
    """The bytes of whole device blocks (see kv_transfer.DeviceBlocks); safe from any thread for pinned blocks."""

    @property
    def format(self) -> BlockFormat: ...

    def read(self, block_ids: Sequence[int]) -> Sequence[memoryview | bytes]: ...


@dataclass(frozen=True, slots=True)
class ExportRead:
    """Encoded blocks of a transfer from some index on, and how the transfer stands."""

    blobs: list[bytes]
    view: ExportView


def read_export(
    exports: KVExports, reader: BlockReader | None, transfer_id: str, start: int, max_blocks: int
) -> ExportRead | None:
    """Blocks `start`, ... of a transfer, encoded in the block codec (any thread: they are pinned while read); None
    when there is no such transfer (yet, or any more)."""
    view = exports.view(transfer_id, start)
    if view is None:
        return None
    if reader is None or not view.block_ids:
        return ExportRead([], view)
    ids, keys = view.block_ids[:max_blocks], view.block_keys[:max_blocks]
    blobs = [encode_block(view.root_key, key, reader.format, row) for key, row in zip(keys, reader.read(ids))]
    if not exports.is_pinned(transfer_id, start + len(ids)):
        return None  # released while being read: the bytes may be another request's by now
    return ExportRead(blobs, view)

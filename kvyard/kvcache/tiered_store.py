"""Tiers composed into one store: lookup top-down with promotion, write-behind through a bounded queue.

Lookups run on the caller's thread (the engine's), tier by tier, and only ever return a contiguous
prefix of the wanted chained keys, since a block is only usable after all its parents. Every blob
is verified against the namespace root, key and expected format before it is returned; one that
fails is removed from its tier and counted. Writes are queued and done by one background thread;
when the queue is full the block is dropped and counted, never waited for.

With an event log attached, the store publishes what its tiers hold (docs/contracts.md §7): `local` events
when the first of the replica's own tiers gains a block or the last one loses it, `shared` events for what it
wrote to (or saw leave) a shared tier, and `cleared` when a shared tier's store id changes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvyard.kvcache.codec import (
    Blob,
    BlockCorruptError,
    BlockFormat,
    BlockRejectedError,
    DecodedBlock,
    decode_block,
    encode_block,
    frame_block,
)
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.stats import StoreSnapshot
from kvyard.kvcache.tier import LoadDeadline, PutResult, Tier

log = logging.getLogger(__name__)

WRITE_BATCH_BLOCKS = 64
PROBE_INTERVAL_S = 1.0  # an idle writer looks at the shared stores this often


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """One block to store: raw payload (encoded by the writer), a frame holding the payload behind HEADER_BYTES of
    room for the header (the writer fills it in place, `codec.frame_block`), or an already-encoded blob."""

    root_key: bytes
    key: bytes
    fmt: BlockFormat
    payload: memoryview | None = None
    blob: bytes | None = None
    frame: memoryview | None = None
    first_tier: int = 0  # write to tiers[first_tier:]; promotions stop above the tier they came from
    last_tier: int | None = None

    @property
    def nbytes(self) -> int:
        if self.blob is not None:
            return len(self.blob)
        if self.frame is not None:
            return self.frame.nbytes
        return self.payload.nbytes if self.payload is not None else 0


class WriteQueue:
    """A FIFO bounded in bytes; `offer` never blocks."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: deque[BlockWrite] = deque()
        self._bytes = 0
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition()

    def offer(self, item: BlockWrite) -> bool:
        with self._cond:
            if self._closed or self._bytes + item.nbytes > self.capacity_bytes:
                return False
            self._items.append(item)
            self._bytes += item.nbytes
            self._cond.notify()
            return True

    def take(self, max_items: int, timeout: float | None = None) -> list[BlockWrite] | None:
        """Wait for work (at most `timeout` s: then []); None once closed and drained. Call `done` after handling a
        batch that is not empty."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed, timeout):
                return []
            if not self._items:
                return None
            batch = [self._items.popleft() for _ in range(min(max_items, len(self._items)))]
            self._bytes -= sum(item.nbytes for item in batch)
            self._busy += 1
            return batch

    def done(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def depth(self) -> tuple[int, int]:
        with self._cond:
            return len(self._items), self._bytes


class LoadedBlocks(list[DecodedBlock]):
    """The blocks of one load, in key order: those the replica's own tiers served come first."""

    __slots__ = ("num_local",)

    def __init__(self, blocks: Sequence[DecodedBlock] = (), num_local: int = 0) -> None:
        super().__init__(blocks)
        self.num_local = min(num_local, len(self))


class TieredStore:
    def __init__(
        self, tiers: Sequence[Tier], queue_bytes: int = 256 << 20, writer_cpus: frozenset[int] | None = None
    ) -> None:
        """`writer_cpus`: where the writer thread runs (None: where the thread creating the store runs)."""
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self.events: KVEventLog | None = None  # set by the engine that publishes this store's events
        self._shared_ids = {index: tier.store_id for index, tier in enumerate(self.tiers) if tier.shared}
        self._queue = WriteQueue(queue_bytes)
        self._dropped = 0
        self._loaded = 0
        self._submitted = 0
        self._counter_lock = threading.Lock()
        self._writer_cpus = writer_cpus
        self._writer = threading.Thread(target=self._write_loop, name="kvyard-kv-writer", daemon=True)
        self._writer.start()

    # ----------------------------------------------------------------- reads (caller's thread)

    def load_prefix(
        self, root_key: bytes, keys: Sequence[bytes], fmt: BlockFormat, deadline: LoadDeadline | float
    ) -> LoadedBlocks:
        """Verified blocks for the longest prefix of `keys` found before `deadline` (a bare float:
        time.monotonic())."""
        blocks = LoadedBlocks()
        deadline = LoadDeadline.of(deadline)
        for index, tier in enumerate(self.tiers):
            if len(blocks) == len(keys) or deadline.passed():
                break
            wanted = keys[len(blocks) :]
            found = self._verified(tier, root_key, wanted, fmt, tier.get_prefix(wanted, deadline))
            tier.stats.add(hits=len(found), misses=int(len(found) < len(wanted)))
            if found and index > 0:
                self._promote(root_key, fmt, found, index)
            blocks.extend(found)
            if not tier.shared:
                blocks.num_local = len(blocks)
        with self._counter_lock:
            self._loaded += len(blocks)
        self._check_shared_stores()
        return blocks

    def _verified(
        self, tier: Tier, root_key: bytes, keys: Sequence[bytes], fmt: BlockFormat, blobs: Sequence[Blob]
    ) -> list[DecodedBlock]:
        blocks: list[DecodedBlock] = []
        for key, blob in zip(keys, blobs):
            try:
                blocks.append(decode_block(blob, root_key, key, fmt))
            except BlockRejectedError as error:
                corrupt = isinstance(error, BlockCorruptError)
                tier.stats.add(corrupt=int(corrupt), mismatched=int(not corrupt))
                log.warning("kv %s tier: dropped block %s: %s", tier.name, key.hex(), error)
                tier.discard(key)
                self._publish_removed(tier, [key])
                break
        return blocks

    def _promote(self, root_key: bytes, fmt: BlockFormat, blocks: list[DecodedBlock], source: int) -> None:
        for block in blocks:
            self._offer(BlockWrite(root_key, block.key, fmt, blob=bytes(block.blob), last_tier=source))

    # ----------------------------------------------------------------- writes (background)

    def submit(self, writes: Sequence[BlockWrite]) -> int:
        """Queue blocks for every tier without blocking; returns how many were accepted."""
        accepted = sum(self._offer(write) for write in writes)
        with self._counter_lock:
            self._submitted += len(writes)
        return accepted

    def _offer(self, write: BlockWrite) -> bool:
        if self._queue.offer(write):
            return True
        with self._counter_lock:
            self._dropped += 1
        return False

    def _write_loop(self) -> None:
        if self._writer_cpus:
            try:
                os.sched_setaffinity(0, self._writer_cpus)  # 0: this thread
            except OSError as error:
                log.warning("kv tier writer: cannot move to CPUs %s: %s", sorted(self._writer_cpus), error)
        while (batch := self._queue.take(WRITE_BATCH_BLOCKS, timeout=PROBE_INTERVAL_S)) is not None:
            if not batch:  # idle: ask the shared stores how they are, so a flush or a stall is seen without traffic
                self._probe_shared_stores()
                continue
            try:
                self._write_batch(batch)
            except Exception:
                log.exception("kv tier writer: batch of %d blocks failed", len(batch))
            finally:
                self._queue.done()

    def _write_batch(self, batch: list[BlockWrite]) -> None:
        encoded = [(write, _encoded(write)) for write in batch]
        for index, tier in enumerate(self.tiers):
            items = [
                (write.key, blob)
                for write, blob in encoded
                if write.first_tier <= index < (write.last_tier if write.last_tier is not None else len(self.tiers))
                and not tier.contains(write.key)
            ]
            if items:
                self._publish_put(tier, tier.put_many(items))
        self._check_shared_stores()

    # ----------------------------------------------------------------- what the tiers hold (KV events)

    def _publish_put(self, tier: Tier, result: PutResult) -> None:
        if self.events is None:
            return
        if tier.shared:
            self.events.record("stored", result.stored, "shared")
        else:  # `stored` only for blocks no other local tier held already
            self.events.record("stored", [key for key in result.stored if not self._held_locally(key, tier)], "local")
        self._publish_removed(tier, result.evicted)

    def _publish_removed(self, tier: Tier, keys: list[bytes]) -> None:
        if self.events is None or not keys:
            return
        if tier.shared:
            self.events.record("removed", keys, "shared")
        else:
            self.events.record("removed", [key for key in keys if not self._held_locally(key, tier)], "local")

    def _held_locally(self, key: bytes, besides: Tier) -> bool:
        return any(tier.contains(key) for tier in self.tiers if tier is not besides and not tier.shared)

    def _probe_shared_stores(self) -> None:
        for tier in self.tiers:
            if tier.shared:
                tier.probe()
        self._check_shared_stores()

    def _check_shared_stores(self) -> None:
        """Say `cleared` when a shared tier's contents have a new id (flushed, restarted, or first reached)."""
        with self._counter_lock:  # the loader and the writer thread both look
            for index, known in self._shared_ids.items():
                current = self.tiers[index].store_id
                if current is not None and current != known:
                    self._shared_ids[index] = current
                    if self.events is not None:
                        self.events.record_cleared(current)

    def shared_store(self) -> tuple[str, float | None] | None:
        """The id of the shared store's contents as last published, and how long it keeps a block; None when
        there is no shared tier or it has not been reached yet."""
        for index, store_id in self._shared_ids.items():
            if store_id is not None:
                return store_id, self.tiers[index].ttl_s
        return None

    def shared_available(self) -> bool:
        """False while a shared tier backs off after failures (its lookups are misses then)."""
        return all(getattr(tier, "available", True) for tier in self.tiers if tier.shared)

    def load_totals(self) -> dict[str, tuple[float, int]]:
        """Seconds spent loading and blocks served so far, by medium (`local`, `shared`)."""
        totals: dict[str, tuple[float, int]] = {}
        for tier in self.tiers:
            counters = tier.stats.snapshot()
            medium = "shared" if tier.shared else "local"
            seconds, blocks = totals.get(medium, (0.0, 0))
            totals[medium] = (seconds + counters.load_seconds, blocks + counters.hits)
        return totals

    def local_keys(self) -> list[bytes]:
        """Every block the replica's own tiers hold (a snapshot for KV-event readers)."""
        keys: set[bytes] = set()
        for tier in self.tiers:
            if not tier.shared:
                keys.update(tier.keys())
        return list(keys)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is done; False on timeout."""
        return self._queue.wait_idle(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.close()
        self._writer.join(timeout)
        for tier in self.tiers:
            tier.close()

    # ----------------------------------------------------------------- stats

    def snapshot(self) -> StoreSnapshot:
        blocks, nbytes = self._queue.depth
        with self._counter_lock:
            return StoreSnapshot(
                tiers={tier.name: tier.stats.snapshot() for tier in self.tiers},
                queue_blocks=blocks,
                queue_bytes=nbytes,
                queue_dropped_blocks=self._dropped,
                loaded_blocks=self._loaded,
                submitted_blocks=self._submitted,
            )


def _encoded(write: BlockWrite) -> Blob:
    if write.blob is not None:
        return write.blob
    if write.frame is not None:
        return frame_block(write.frame, write.root_key, write.key, write.fmt)
    assert write.payload is not None
    return encode_block(write.root_key, write.key, write.fmt, write.payload)

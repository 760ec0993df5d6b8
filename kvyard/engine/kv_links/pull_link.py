"""The decode side of a transfer: pull a request's blocks from the replica that prefilled it.

Pulls run on their own threads (many at once: they mostly wait, on the network and the remote prefill), each
bounded by the transfer's deadline and idle timeout; the engine admits the request when its pull has ended, however it
ended, and computes what the pull did not bring. Choices of one request (`n > 1`) share one pull. After a
pull the prefill side is told to release its lease; counters say how pulls went and why any fell back.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvyard.kvcache.codec import BlockFormat, DecodedBlock
from kvyard.kvcache.pd_stream import PulledBlocks, PullLimits, TransferHandle, pull_blocks, release_transfer

MAX_PARALLEL_PULLS = 32  # a pull holds its thread while its prompt is prefilled elsewhere: mostly waiting


class BlockWriter(Protocol):
    """Where pulled blocks go: the device cache (kv_transfer.DeviceBlocks), or the simulator's stand-in."""

    @property
    def format(self) -> BlockFormat: ...

    def write(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None: ...


@dataclass(slots=True)
class PullCounters:
    pulls: int = 0
    complete: int = 0  # pulls that brought every block asked for
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fallbacks: Counter[str] = field(default_factory=Counter)  # pulls that fell short, by reason

    def copy(self) -> PullCounters:
        return PullCounters(self.pulls, self.complete, self.blocks, self.bytes, self.seconds, Counter(self.fallbacks))


class KVPullLink:
    def __init__(self, device: BlockWriter, limits: PullLimits) -> None:
        self.device = device
        self.limits = limits
        self._counters = PullCounters()
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, str], Future[Sequence[DecodedBlock]]] = {}
        self._threads = ThreadPoolExecutor(max_workers=MAX_PARALLEL_PULLS, thread_name_prefix="kvyard-kv-pull")

    def start_pull(
        self,
        handle: TransferHandle,
        root_key: bytes,
        keys: Sequence[bytes],
        first_block: int,
        block_ids: Sequence[int] | None = None,
    ) -> Future[Sequence[DecodedBlock]]:
        with self._lock:
            future = self._in_flight.get((handle.source, handle.transfer_id))
            if future is None:
                writer = _InPlaceWriter(self.device, list(block_ids)) if block_ids is not None else None
                future = self._threads.submit(self._pull, handle, root_key, list(keys), first_block, writer)
                self._in_flight[handle.source, handle.transfer_id] = future
            return future

    def pulling(self, handle: TransferHandle) -> bool:
        with self._lock:
            return (handle.source, handle.transfer_id) in self._in_flight

    def release(self, handle: TransferHandle) -> None:
        self._threads.submit(release_transfer, handle, self.limits.headers, self.limits.idle_s)

    def install(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None:
        self.device.write(block_ids, blocks)

    def counters(self) -> PullCounters:
        with self._lock:
            return self._counters.copy()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _pull(
        self,
        handle: TransferHandle,
        root_key: bytes,
        keys: list[bytes],
        first_block: int,
        writer: _InPlaceWriter | None,
    ) -> PulledBlocks:
        sink = writer.add if writer is not None else None
        try:
            result = pull_blocks(handle, root_key, keys, first_block, self.device.format, self.limits, sink)
        finally:
            if writer is not None:
                writer.flush()
        if result.failure not in ("connect",):
            release_transfer(handle, self.limits.headers, self.limits.idle_s)
        with self._lock:
            self._in_flight.pop((handle.source, handle.transfer_id), None)
            counters = self._counters
            counters.pulls += 1
            counters.blocks += len(result)
            counters.bytes += result.num_bytes
            counters.seconds += result.seconds
            if result.failure is None:
                counters.complete += 1
            else:
                counters.fallbacks[result.failure] += 1
        return result


@dataclass(slots=True)
class _InPlaceWriter:
    """Writes pulled blocks into the blocks reserved for them, a batch at a time, on the pull's thread. Nothing
    else touches reserved blocks until the engine adopts them, so writing them while the engine steps is safe."""

    device: BlockWriter
    block_ids: list[int]
    batch: int = 16
    _pending: list[tuple[int, DecodedBlock]] = field(default_factory=list)

    def add(self, index: int, block: DecodedBlock) -> None:
        self._pending.append((index, block))
        if len(self._pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.device.write([self.block_ids[i] for i, _ in self._pending], [b for _, b in self._pending])
            self._pending = []

"""KV transfers between simulated replicas (prefill/decode disaggregation): real pulls of stand-in blocks, charged
the time the simulated model's KV would take to move.

A simulated replica has no KV, so its blocks are `STAND_IN_FORMAT` payloads of a few bytes; they still travel over
HTTP in kvyard's block codec (namespace root, key, CRC), are verified and registered exactly as a real replica's.
The pull itself is the engine's own `KVPullLink`, which receives blocks as the prefill replica computes them;
`ModeledPuller` holds back each finished pull for what the model's transfer would still take then
(`SimConfig.streamed_transfer_seconds`: at least the last chunk's blocks, and never faster than the link's
bandwidth from when the pull opened), times `time_scale`. Nothing here blocks the event loop: the delay runs on a
timer thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvyard.engine.kv_links.pull_link import KVPullLink
from kvyard.kvcache.codec import BlockFormat, DecodedBlock
from kvyard.kvcache.pd_stream import TransferHandle
from kvyard.sim.config import SimConfig

STAND_IN_FORMAT = BlockFormat("uint8", (16,))


class StandInBlocks:
    """The simulator's device blocks: a reader for exports and a writer for pulls, holding no KV."""

    format = STAND_IN_FORMAT

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        return [block_id.to_bytes(STAND_IN_FORMAT.num_elements, "little") for block_id in block_ids]

    def write(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None:
        """Nothing to store: the blocks were verified, and registering them is the engine's part."""


@dataclass(slots=True)
class ModeledTransfers:
    """What the pulls would have cost in the simulated model."""

    bytes: int = 0
    seconds: float = 0.0  # simulated, held back after the pulls ended (streamed_transfer_seconds)


class ModeledPuller:
    """A `BlockPuller`: pulls through `link`, and completes each pull the modeled transfer time of the blocks it
    brought (wall seconds: simulated ones times `time_scale`) after the real pull ended. Requests that share a pull
    (the choices of one request) share its modeled transfer too."""

    def __init__(self, link: KVPullLink, config: SimConfig) -> None:
        self.link = link
        self.config = config
        self._modeled = ModeledTransfers()
        self._held: dict[Future[Sequence[DecodedBlock]], Future[Sequence[Any]]] = {}
        self._lock = threading.Lock()

    def start_pull(
        self,
        handle: TransferHandle,
        root_key: bytes,
        keys: Sequence[bytes],
        first_block: int,
        block_ids: Sequence[int] | None = None,
    ) -> Future[Sequence[Any]]:
        pulled = self.link.start_pull(handle, root_key, keys, first_block, block_ids)
        with self._lock:
            modeled = self._held.get(pulled)
            if modeled is not None:
                return modeled
            modeled = self._held[pulled] = Future()
        opened = time.monotonic()
        pulled.add_done_callback(lambda done: self._hold_back(done, modeled, opened))
        return modeled

    def pulling(self, handle: TransferHandle) -> bool:
        return self.link.pulling(handle)

    def release(self, handle: TransferHandle) -> None:
        self.link.release(handle)

    def install(self, block_ids: Sequence[int], blocks: Sequence[Any]) -> None:
        self.link.install(block_ids, blocks)

    def close(self) -> None:
        self.link.close()

    def modeled(self) -> ModeledTransfers:
        with self._lock:
            return ModeledTransfers(self._modeled.bytes, self._modeled.seconds)

    def _hold_back(self, pulled: Future[Sequence[DecodedBlock]], modeled: Future[Sequence[Any]], opened: float) -> None:
        with self._lock:
            self._held.pop(pulled, None)
        if pulled.cancelled():  # the link was closed: the replica is stopping
            modeled.cancel()
            return
        error = pulled.exception()
        if error is not None:
            modeled.set_exception(error)
            return
        blocks = pulled.result()
        open_s = (time.monotonic() - opened) / self.config.time_scale
        seconds = self.config.streamed_transfer_seconds(len(blocks), open_s)
        with self._lock:
            self._modeled.bytes += len(blocks) * self.config.kv_bytes_per_block
            self._modeled.seconds += seconds
        timer = threading.Timer(seconds * self.config.time_scale, modeled.set_result, (blocks,))
        timer.daemon = True
        timer.start()

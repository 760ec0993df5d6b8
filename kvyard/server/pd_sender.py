"""`GET /kv/transfer`: a prefill replica sends a request's blocks to the decode replica pulling them.

Blocks go out as soon as prefill has computed them (a decode replica starts pulling while prefill runs), in
the frames of `kvyard.kvcache.pd_stream`, with a heartbeat every second while nothing is ready. A pull may
arrive before its prefill request does (the router sends both at once): an unknown transfer id is awaited
for `APPEAR_WAIT_S`, then answered with a failed end frame, as is a transfer released or expired meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvyard.engine.kv_links.exports import OPEN
from kvyard.kvcache.pd_stream import BLOCK, HEARTBEAT, TransferStatus, end_frame, frame, info_frame
from kvyard.net.http_server import Responder
from kvyard.server.backend import ReplicaEngine

APPEAR_WAIT_S = 10.0
HEARTBEAT_S = 1.0
POLL_S = (0.002, 0.02)  # the wait between looks for new blocks, doubling from the first to the second while idle
TRANSFER_HEADERS = {"Content-Type": "application/octet-stream", "Cache-Control": "no-cache"}


async def send_transfer(
    engine: ReplicaEngine, transfer_id: str, start: int, responder: Responder, stopping: Callable[[], bool]
) -> None:
    responder.start(200, TRANSFER_HEADERS)
    responder.flush_head()
    next_block, seen, told_cached = start, False, False
    opened = last_write = time.monotonic()
    poll_s = POLL_S[0]
    while not stopping():
        read = await engine.read_export(transfer_id, next_block)
        now = time.monotonic()
        if read is None:
            if seen or now - opened > APPEAR_WAIT_S:
                reason = "released" if seen else "unknown_transfer"
                responder.write(end_frame(TransferStatus.FAILED, reason, next_block))
                break
        else:
            seen = True
            if not told_cached and read.view.num_cached_tokens >= 0:
                responder.write(info_frame(read.view.num_cached_tokens))
                told_cached = True
            for blob in read.blobs:
                responder.write(frame(BLOCK, blob))
            next_block += len(read.blobs)
            if read.blobs:
                last_write = now
            view = read.view
            if view.status != OPEN and next_block >= view.num_blocks:
                responder.write(end_frame(view.status, view.reason, view.num_blocks))
                break
            if read.blobs:
                poll_s = POLL_S[0]
                continue
        if now - last_write >= HEARTBEAT_S:
            responder.write(frame(HEARTBEAT))
            last_write = now
        await asyncio.sleep(poll_s)
        poll_s = min(poll_s * 2, POLL_S[1])
    responder.end()

"""Moving KV blocks from a prefill replica to a decode replica (docs/contracts.md §6).

The prefill replica serves `GET /kv/transfer?id=<transfer id>&from=<block index>` as a stream of frames:
each frame is one kind byte, a 4-byte little-endian length and a body. A `B` frame holds one block in the
block codec (namespace root, key, layout, dtype, shape, CRC-32), in the order of the request's blocks and as
soon as prefill has computed it; an `I` frame (JSON) says how many prompt tokens the prefill replica found in
its own cache, as soon as it knows; `H` frames are heartbeats while prefill runs (or waits); one `E` frame
ends the stream with a JSON status. The decode replica reads it with `pull_blocks` on a thread of its own, verifies
every block against the key it expects, and stops at the first block that fails: what it pulled before is a
valid prefix, the rest it computes itself. Every read is bounded by an idle timeout (a peer that dies or
stalls) and the whole pull by a deadline, so a transfer can fail but never hang.

Why the standard library's blocking `http.client` here and not `kvyard.net.http_client`, the package's client
everywhere else: a pull runs on a thread of the engine's (engine.kv_pull_link), which has no event loop, and
reads a frame at a time with exact-length reads; the asyncio client would need a loop per thread or a hop
to the server's loop for every frame.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from kvyard.kvcache.codec import BlockFormat, BlockMismatchError, BlockRejectedError, DecodedBlock, decode_block

TRANSFER_PATH = "/kv/transfer"
RELEASE_PATH = "/kv/transfer/release"
# One transfer's credential: the router gives both legs a fresh token, and the decode replica shows only that to
# the prefill replica, never a key of its own.
TRANSFER_TOKEN_HEADER = "X-Kvyard-Transfer-Token"
BLOCK, HEARTBEAT, INFO, END = b"B", b"H", b"I", b"E"
_FRAME = struct.Struct("<cI")
MAX_FRAME_BYTES = 1 << 30


class TransferStatus:
    """How an export ended, as its `E` frame says."""

    COMPLETE = "complete"  # every block the request computed was sent
    FAILED = "failed"  # the prefill request was aborted, its lease expired, or the lease cap was reached


def frame(kind: bytes, body: bytes = b"") -> bytes:
    return _FRAME.pack(kind, len(body)) + body


def end_frame(status: str, reason: str = "", num_blocks: int = 0) -> bytes:
    """The last frame of a transfer: how it ended and the blocks sent in all."""
    return frame(END, json.dumps({"status": status, "reason": reason, "num_blocks": num_blocks}).encode())


def info_frame(num_cached_tokens: int) -> bytes:
    """The prompt tokens the prefill replica found in its own cache: neither side computes them."""
    return frame(INFO, json.dumps({"num_cached_tokens": num_cached_tokens}).encode())


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """Where a decode replica finds the blocks of a request prefilled elsewhere."""

    source: str  # base URL of the prefill replica, e.g. http://10.0.0.5:8000
    transfer_id: str
    token: str | None = None  # the transfer's own credential (then the pull carries no other)

    def headers(self, fallback: Mapping[str, str]) -> dict[str, str]:
        """What a call to the source carries: the transfer's token, or (a transfer without one) `fallback`."""
        return {TRANSFER_TOKEN_HEADER: self.token} if self.token else dict(fallback)


class PulledBlocks(list[DecodedBlock]):
    """The verified blocks of a pull, in order, with what the prefill replica reported about them."""

    source_cached_tokens: int | None = None  # prompt tokens the prefill replica did not compute either
    failure: str | None = None  # why the pull stopped short; None when it got everything it asked for
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class PullLimits:
    deadline_s: float  # the whole pull, waiting for prefill included
    idle_s: float  # longest silence from the prefill replica (it sends heartbeats)
    headers: Mapping[str, str] = field(default_factory=dict)


BlockSink = Callable[[int, DecodedBlock], None]  # (index among the pulled blocks, the verified block)


def pull_blocks(
    handle: TransferHandle,
    root_key: bytes,
    keys: Sequence[bytes],
    first_block: int,
    fmt: BlockFormat,
    limits: PullLimits,
    on_block: BlockSink | None = None,
) -> PulledBlocks:
    """Blocks `first_block`, `first_block + 1`, ... of a transfer, verified against `keys` (the keys of those
    blocks), until all of `keys` are in or the transfer ends; never raises for a transfer that fails.
    `on_block` sees each verified block as it arrives (to write it into the cache at once)."""
    result = PulledBlocks()
    started = time.monotonic()
    deadline = started + limits.deadline_s
    connection: http.client.HTTPConnection | None = None
    try:
        connection = _connect(handle.source, limits.idle_s)
        path = f"{TRANSFER_PATH}?id={quote(handle.transfer_id)}&from={first_block}"
        connection.request("GET", path, headers=handle.headers(limits.headers))
        response = connection.getresponse()
        if response.status != 200:
            result.failure = f"http_{response.status}"
            return result
        _read_frames(response, root_key, keys, fmt, deadline, result, on_block)
    except TimeoutError:
        result.failure = "timeout"
    except (ConnectionRefusedError, socket.gaierror):
        result.failure = "connect"
    except (OSError, http.client.HTTPException, ValueError):
        result.failure = "connection_lost"
    finally:
        if connection is not None:
            connection.close()
        result.seconds = time.monotonic() - started
    return result


def _read_frames(
    response: http.client.HTTPResponse,
    root_key: bytes,
    keys: Sequence[bytes],
    fmt: BlockFormat,
    deadline: float,
    result: PulledBlocks,
    on_block: BlockSink | None,
) -> None:
    while len(result) < len(keys):
        if time.monotonic() > deadline:
            result.failure = "timeout"
            return
        kind, body = _read_frame(response)
        if kind == HEARTBEAT:
            continue
        if kind == INFO:
            cached = json.loads(body).get("num_cached_tokens")
            result.source_cached_tokens = cached if isinstance(cached, int) else None
            continue
        if kind == END:
            status: dict[str, Any] = json.loads(body)
            result.failure = "source_" + str(status.get("reason") or status.get("status") or "ended")
            return
        if kind != BLOCK:
            raise ValueError(f"unknown frame kind {kind!r}")
        result.num_bytes += len(body)
        try:
            block = decode_block(body, root_key, keys[len(result)], fmt)
        except BlockMismatchError:
            result.failure = "mismatch"
            return
        except BlockRejectedError:
            result.failure = "corrupt"
            return
        if on_block is not None:
            on_block(len(result), block)
        result.append(block)


def _read_frame(response: http.client.HTTPResponse) -> tuple[bytes, bytes]:
    head = _read_exactly(response, _FRAME.size)
    kind, length = _FRAME.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes")
    return kind, _read_exactly(response, length) if length else b""


def _read_exactly(response: http.client.HTTPResponse, size: int) -> bytes:
    data = response.read(size)
    if len(data) != size:
        raise http.client.IncompleteRead(data, size - len(data))
    return data


def release_transfer(handle: TransferHandle, headers: Mapping[str, str], timeout_s: float) -> bool:
    """Tell the prefill replica its blocks are no longer needed (best effort: its lease frees them anyway)."""
    try:
        connection = _connect(handle.source, timeout_s)
        try:
            path = f"{RELEASE_PATH}?id={quote(handle.transfer_id)}"
            connection.request("POST", path, headers=handle.headers(headers))
            return connection.getresponse().status == 200
        finally:
            connection.close()
    except (OSError, http.client.HTTPException):
        return False


def _connect(base_url: str, timeout_s: float) -> http.client.HTTPConnection:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {base_url!r}")
    if parts.scheme == "https":
        return http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout_s, context=ssl.create_default_context()
        )
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)

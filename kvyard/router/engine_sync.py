"""Follows one vLLM or SGLang replica's KV events over ZMQ, keeping its cache index (`engine_index`) current.

Every batch carries a sequence number (from 0 when the publisher starts) and a timestamp. The index follows the
stream only while continuity holds; whenever it cannot be sure, it starts over from what the publisher's replay
socket still holds, which is the publisher's whole history until its buffer (vLLM: 10,000 batches) rolls over:

- connected (the socket monitor says so, also after a reconnect): rebuilt from the replay of everything;
- a batch whose number skips ahead: the missing batches are replayed; when the replay no longer has them, the
  index is rebuilt from what it has (an older block the router never learns of is a miss, never a wrong hit);
- a batch numbered below the next one but stamped later than the last one: the publisher restarted (a new
  engine process with an empty cache), so rebuilt; one stamped earlier is a copy already applied, skipped;
- `AllBlocksCleared`: emptied;
- disconnected: the exact index is dropped, and the replica is routed by its load and the prompts sent to it
  until it connects again.

A publisher without a replay socket gets the same rules with nothing to replay: a rebuild starts empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from kvyard.api.engine_kv_events import (
    END_OF_REPLAY,
    AllCleared,
    EventBatch,
    EventBatchDecoder,
    EventEndpoints,
    EventFormatError,
    replay_request,
)
from kvyard.router.engine_index import EngineBlockKeys
from kvyard.router.replica import Replica

_LOG = logging.getLogger(__name__)
REPLAY_IDLE_TIMEOUT_S = 2.0  # a replay that sends nothing for this long has failed
UNREACHABLE_WARNING_S = 10.0
# After the index learns it misses blocks the engine holds, this long the router asks vLLM to announce the blocks
# each request reuses (their keys are learned back from the requests that hit them).
REPORT_REUSE_S = 60.0
MAX_REPLAY_TRIES = 3
_EVENTS: Final = int(zmq.EVENTS)  # plain ints: flag arithmetic on pyzmq's enums costs microseconds
_POLLIN: Final = int(zmq.POLLIN)
_ANY = -1  # `expected` while a rebuild had nothing to replay: the next batch starts the stream


@dataclass(slots=True)
class EngineEventSync:
    replica: Replica
    endpoints: EventEndpoints
    context: zmq.asyncio.Context
    on_resync: Callable[[Replica, str], None]
    blocks: EngineBlockKeys
    decoder: EventBatchDecoder = field(default_factory=EventBatchDecoder)
    expected: int = _ANY  # the next batch's sequence number
    last_timestamp: float = 0.0
    live: bool = False  # connected, and the index follows the stream

    async def run(self) -> None:
        # Plain (not zmq.asyncio) sockets on the same context, read from the event loop's own reader callbacks: a
        # zmq.asyncio poll or receive makes futures and timers for every batch, which cost the router more CPU than
        # the batches' contents (one or a few batches a request).
        plain: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self.context.underlying)
        sub = plain.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoints.publisher)
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        descriptors = [cast(int, socket.getsockopt(zmq.FD)) for socket in (sub, monitor)]
        for socket, descriptor in zip((sub, monitor), descriptors):
            loop.add_reader(descriptor, _poke, socket, wake)
        warning = loop.call_later(UNREACHABLE_WARNING_S, self._warn_unreachable)
        try:
            while True:
                # A ZMQ socket's descriptor only says that its state changed: what is readable is in its EVENTS,
                # which are read again after every receive and before every wait.
                if not (_readable(monitor) or _readable(sub)):
                    wake.clear()
                    await wake.wait()
                while _readable(monitor):
                    await self._on_connection(recv_monitor_message(monitor, zmq.NOBLOCK))
                await self._drain(sub)
                if self.live:
                    warning.cancel()
        finally:
            warning.cancel()
            for descriptor in descriptors:
                loop.remove_reader(descriptor)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._drop()

    def _warn_unreachable(self) -> None:
        if not self.live:
            _LOG.warning(
                "KV events of %s: nothing answers at %s yet; it is routed by its load and the prompts sent to it "
                "until it does",
                self.replica.url,
                self.endpoints,
            )

    async def _on_connection(self, message: Any) -> None:
        if message["event"] == zmq.EVENT_CONNECTED:
            _LOG.info("following the KV events of %s at %s", self.replica.url, self.endpoints)
            await self.rebuild("connect")
        elif message["event"] == zmq.EVENT_DISCONNECTED and self.live:
            _LOG.warning(
                "KV events of %s: publisher %s went away; routing it without its index until it is back",
                self.replica.url,
                self.endpoints.publisher,
            )
            self._drop()

    async def _drain(self, sub: zmq.Socket[bytes]) -> None:
        """Every batch waiting on the socket (a burst is read at once, without a wait per batch)."""
        while _readable(sub):
            frames = sub.recv_multipart(zmq.NOBLOCK)
            try:
                batch = self.decoder.decode(frames)
            except EventFormatError as error:
                _LOG.warning("KV events of %s: unreadable batch (%s); rebuilding its index", self.replica.url, error)
                await self.rebuild("unreadable")
                continue
            if self.live:
                await self._receive(batch)

    async def _receive(self, batch: EventBatch) -> None:
        if batch.seq == self.expected or self.expected == _ANY:
            self._apply(batch)
        elif batch.seq > self.expected:
            await self._fill_gap(batch)
        elif batch.timestamp > self.last_timestamp:
            await self.rebuild("restart")
            self._apply(batch)  # unless the replay had it

    async def _fill_gap(self, batch: EventBatch) -> None:
        replayed = await self._replay(self.expected) or []
        if replayed and replayed[0].seq == self.expected:
            for old in replayed:
                self._apply(old)
        if batch.seq > self.expected:  # batches are gone for good: start over from what the replay holds
            await self.rebuild("gap")
        self._apply(batch)  # unless it was replayed

    async def rebuild(self, reason: str) -> None:
        """Start the index over from the publisher's replay buffer."""
        self.blocks.reset(0)
        self.expected, self.last_timestamp, self.live = _ANY, 0.0, True
        replayed = await self._replay(0)
        if replayed is None or (replayed and replayed[0].seq != 0):
            self.blocks.missed_at = time.monotonic()  # no replay, or its buffer no longer starts at the beginning
        for batch in replayed or ():
            self._apply(batch)
        self.replica.namespace = self.blocks.namespace
        self.replica.report_reuse_until = self.blocks.missed_at + REPORT_REUSE_S
        self.on_resync(self.replica, reason)

    def _apply(self, batch: EventBatch) -> None:
        if self.expected != _ANY and batch.seq < self.expected:
            return
        blocks = self.blocks
        for event in batch.events:
            blocks.apply(batch.seq, event)
            if isinstance(event, AllCleared):
                self.on_resync(self.replica, "cleared")
        self.expected = batch.seq + 1
        self.last_timestamp = max(self.last_timestamp, batch.timestamp)
        if self.replica.namespace is not blocks.namespace:  # the events' block size replaced the configured one
            self.replica.namespace = blocks.namespace
        self.replica.report_reuse_until = blocks.missed_at + REPORT_REUSE_S

    def _drop(self) -> None:
        self.live = False
        self.blocks.index.forget_events()
        self.expected = _ANY

    async def _replay(self, start: int) -> list[EventBatch] | None:
        """The batches the publisher still holds from `start` on, contiguous; None when it cannot replay."""
        if self.endpoints.replay is None:
            return None
        batches: list[EventBatch] = []
        for _ in range(MAX_REPLAY_TRIES):
            received = await self._ask_replay(start if not batches else batches[-1].seq + 1)
            if received is None:
                return batches or None
            for batch in received:
                if batches and batch.seq != batches[-1].seq + 1:
                    break  # a batch the replay socket dropped (its queue was full): ask again from there
                batches.append(batch)
            else:
                return batches
        return batches

    async def _ask_replay(self, start: int) -> list[EventBatch] | None:
        assert self.endpoints.replay is not None
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a replay arrives all at once: never drop part of it here
        dealer.connect(self.endpoints.replay)
        batches: list[EventBatch] = []
        try:
            await dealer.send_multipart(replay_request(start))
            while await dealer.poll(int(REPLAY_IDLE_TIMEOUT_S * 1000)):
                frames = await dealer.recv_multipart()
                if frames and not frames[0]:
                    frames = frames[1:]  # the empty delimiter the ROUTER socket sends first
                if len(frames) >= 2 and int.from_bytes(frames[1], "big", signed=True) == END_OF_REPLAY:
                    return batches
                batches.append(self.decoder.decode(frames))
            _LOG.warning(
                "KV events of %s: replay from %s at %s timed out", self.replica.url, start, self.endpoints.replay
            )
            return None
        except (EventFormatError, zmq.ZMQError) as error:
            _LOG.warning("KV events of %s: replay failed: %s", self.replica.url, error)
            return None
        finally:
            dealer.close(linger=0)


def _readable(socket: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, socket.getsockopt(_EVENTS)) & _POLLIN)


def _poke(socket: zmq.Socket[bytes], wake: asyncio.Event) -> None:
    """The socket's descriptor signalled: reading its EVENTS clears the signal (else the loop would call this again
    and again while the task is busy elsewhere, as in a replay), and the task looks at what is readable."""
    socket.getsockopt(_EVENTS)
    wake.set()

"""The async load client: sends each session's requests, streaming, and stamps every output chunk.

Arrivals: closed loop (at most `concurrency` requests in flight), open loop (sessions start at
Poisson times of rate `request_rate`, optionally also capped by `concurrency`), or the workload's own
arrival times (trace timestamps). HTTP goes through kvyard.net.http_client, whose body callback lets the
events of a stream be parsed the moment their bytes arrive, without a coroutine hop per chunk.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvyard.bench.prefix import PrefixTracker
from kvyard.bench.records import RequestRecord
from kvyard.bench.workloads import RequestSpec, Session, Workload
from kvyard.net.http_client import HttpClient, HttpError

WARM_CONNECTIONS = 64  # opened before the clock starts (at most the concurrency)


@dataclass(frozen=True, slots=True)
class Arrivals:
    concurrency: int | None = None  # closed loop bound on requests in flight
    request_rate: float | None = None  # open loop: Poisson session starts per second
    use_workload_times: bool = False  # trace timestamps
    seed: int = 0

    @property
    def mode(self) -> str:
        if self.request_rate is not None:
            return "poisson"
        if self.use_workload_times:
            return "trace"
        return "closed"

    def start_times(self, sessions: list[Session]) -> list[float]:
        """When each session starts, in seconds after the benchmark's start."""
        if self.request_rate is not None:
            rng = random.Random(f"arrivals:{self.seed}")
            times, now = [], 0.0
            for _ in sessions:
                times.append(now)
                now += rng.expovariate(self.request_rate)
            return times
        if self.use_workload_times:
            return [s.arrival or 0.0 for s in sessions]
        return [0.0] * len(sessions)


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What every request carries besides its prompt and max_tokens."""

    base_url: str
    model: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 600.0

    def body(self, spec: RequestSpec) -> bytes:
        payload: dict[str, Any] = {
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model is not None:
            payload["model"] = self.model
        if self.ignore_eos:
            payload["ignore_eos"] = True
        return json.dumps(payload, separators=(",", ":")).encode()

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass(frozen=True, slots=True)
class Progress:
    in_flight: int
    streaming: int  # in flight with their first token in
    chunks: int  # output chunks received, finished requests included


@dataclass(slots=True)
class LoadClient:
    options: RequestOptions
    arrivals: Arrivals
    ideal_block_size: int = 16
    on_done: Callable[[RequestRecord], None] | None = None
    records: list[RequestRecord] = field(default_factory=list)
    active: dict[int, RequestRecord] = field(default_factory=dict)  # sent, not finished: record index -> record
    finished_chunks: int = 0  # output chunks of the finished requests
    origin: float = 0.0  # time.monotonic() at the start; record times are relative to it

    async def run(self, workload: Workload) -> list[RequestRecord]:
        tracker = PrefixTracker(self.ideal_block_size)
        limit = self.arrivals.concurrency
        gate: asyncio.Semaphore | None = asyncio.Semaphore(limit) if limit else None
        starts = self.arrivals.start_times(workload.sessions)
        http = HttpClient(self.options.base_url, self.options.headers())
        # Connections opened while the clock runs would add their set-up to the first TTFTs, and in an open
        # loop a client that falls behind would open many at once and fall further behind.
        await http.warm_up(min(limit or WARM_CONNECTIONS, WARM_CONNECTIONS, len(workload.sessions)))
        self.origin = time.monotonic()
        tasks = []
        try:
            for index, (session, start) in sorted(enumerate(zip(workload.sessions, starts)), key=_by_start):
                await _sleep_until(self, start)  # one timer at a time: sessions start when they are due
                tasks.append(asyncio.create_task(self._session(http, index, session, start, gate, tracker)))
            await asyncio.gather(*tasks)
        finally:
            http.close()
        return self.records

    def now(self) -> float:
        return time.monotonic() - self.origin

    def progress(self) -> Progress:
        """What is running now: requests in flight, those already streaming, output chunks received so far."""
        streaming = sum(1 for record in self.active.values() if record.token_times)
        chunks = self.finished_chunks + sum(len(record.token_times) for record in self.active.values())
        return Progress(len(self.active), streaming, chunks)

    async def _session(
        self,
        http: HttpClient,
        index: int,
        session: Session,
        start: float,
        gate: asyncio.Semaphore | None,
        tracker: PrefixTracker,
    ) -> None:
        scheduled = None if self.arrivals.mode == "closed" else start
        previous: RequestRecord | None = None
        for turn in itertools.count():
            if gate is not None:
                await gate.acquire()
            try:
                # Built under the gate, so a closed loop holds only `concurrency` prompts in memory.
                spec = session.next_request(previous)
                if spec is None:
                    return
                if spec.delay > 0:
                    await _think(spec.delay, gate)
                record = RequestRecord(
                    index=len(self.records),
                    session=index,
                    turn=turn,
                    prompt_tokens=len(spec.prompt),
                    max_tokens=spec.max_tokens,
                    scheduled=scheduled if turn == 0 else None,
                )
                self.records.append(record)
                record.ideal_cached_tokens = tracker.observe(spec.prompt)
                await self._send(http, spec, record)
                previous = record
            finally:
                if gate is not None:
                    gate.release()

    async def _send(self, http: HttpClient, spec: RequestSpec, record: RequestRecord) -> None:
        body = self.options.body(spec)
        events = _EventStream(record, self.origin)
        record.start = self.now()
        self.active[record.index] = record
        try:
            response = await http.request("POST", "/v1/completions", body, events.feed, self.options.timeout)
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.error_message = bytes(response.body[:500]).decode(errors="replace")
            elif not events.done and record.error is None:
                record.error, record.error_message = "incomplete_stream", "the stream ended without [DONE]"
        except TimeoutError:
            record.error, record.error_message = "timeout", f"no complete answer within {self.options.timeout}s"
        except HttpError as error:
            record.error, record.error_message = "connection", str(error)
        record.end = self.now()
        del self.active[record.index]
        self.finished_chunks += len(record.token_times)
        if record.output_tokens == 0:
            record.output_tokens = events.chunks
        if self.on_done is not None:
            self.on_done(record)


@dataclass(slots=True)
class _EventStream:
    """Server-sent events of one completion stream, parsed as their bytes arrive. Every event that carries
    output text stamps the time its bytes arrived."""

    record: RequestRecord
    origin: float
    pending: bytes = b""
    chunks: int = 0
    done: bool = False

    def feed(self, data: bytes, arrived: float) -> None:
        if self.done:
            return
        pending = self.pending + data
        if b"\r" in pending:
            pending = pending.replace(b"\r\n", b"\n")
        *lines, self.pending = pending.split(b"\n")
        payloads = []
        for line in lines:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    break
                payloads.append(payload)
        if not payloads:
            return
        try:
            # One parse for everything that arrived together: a JSON array of the events' payloads.
            chunks = json.loads(b"[" + b",".join(payloads) + b"]")
            for chunk in chunks:
                if self._take(chunk, arrived - self.origin):
                    self.done = True
                    return
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            self.record.error, self.record.error_message = "bad_response", f"{type(error).__name__}: {error}"
            self.done = True

    def _take(self, chunk: dict[str, Any], arrived: float) -> bool:
        """Apply one event; True when it was an error event."""
        record = self.record
        if "error" in chunk:
            record.error, record.error_message = "stream_error", json.dumps(chunk["error"])[:500]
            return True
        choices = chunk.get("choices")
        if choices and (choices[0].get("text") or (choices[0].get("finish_reason") and not record.token_times)):
            # A finishing chunk counts when no text came before it: an answer whose tokens decode to no
            # text yet (part of a UTF-8 character) still has a first token.
            record.token_times.append(arrived)
            self.chunks += 1
        if usage := chunk.get("usage"):
            _read_usage(record, usage)
        return False


def _read_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    if usage.get("prompt_tokens") is not None:
        record.server_prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])


async def _think(delay: float, gate: asyncio.Semaphore | None) -> None:
    """Think time is spent outside the gate: a user who is reading holds no request slot."""
    if gate is not None:
        gate.release()
    try:
        await asyncio.sleep(delay)
    finally:
        if gate is not None:
            await gate.acquire()


def _by_start(item: tuple[int, tuple[Session, float]]) -> float:
    return item[1][1]


async def _sleep_until(client: LoadClient, start: float) -> None:
    """Wait for `start`; when it has already passed, still let the sessions started so far run first, so that
    a client that fell behind catches up one session at a time instead of in one burst."""
    await asyncio.sleep(max(0.0, start - client.now()))

"""The async load client: sends each session's requests, streaming, and stamps every output chunk.

Arrivals: closed loop (at most `concurrency` requests in flight), open loop (sessions start at
Poisson times of rate `request_rate`, optionally also capped by `concurrency`), or the workload's own
arrival times (trace timestamps). aiohttp rather than httpx: its streaming read path costs several
times less CPU per request, which is what lets one Python process drive thousands of requests/s.
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

import aiohttp

from kvyard.bench.prefix import PrefixTracker
from kvyard.bench.records import RequestRecord
from kvyard.bench.workloads import RequestSpec, Session, Workload


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


@dataclass(slots=True)
class LoadClient:
    options: RequestOptions
    arrivals: Arrivals
    ideal_block_size: int = 16
    on_done: Callable[[RequestRecord], None] | None = None
    records: list[RequestRecord] = field(default_factory=list)
    origin: float = 0.0  # time.perf_counter() at the start; record times are relative to it

    async def run(self, workload: Workload) -> list[RequestRecord]:
        tracker = PrefixTracker(self.ideal_block_size)
        limit = self.arrivals.concurrency
        gate: asyncio.Semaphore | None = asyncio.Semaphore(limit) if limit else None
        connector = aiohttp.TCPConnector(limit=limit or 0, force_close=False, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.options.timeout)
        starts = self.arrivals.start_times(workload.sessions)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.options.headers()) as http:
            self.origin = time.perf_counter()
            tasks = [
                asyncio.create_task(self._session(http, index, session, start, gate, tracker))
                for index, (session, start) in enumerate(zip(workload.sessions, starts))
            ]
            await asyncio.gather(*tasks)
        return self.records

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def _session(
        self,
        http: aiohttp.ClientSession,
        index: int,
        session: Session,
        start: float,
        gate: asyncio.Semaphore | None,
        tracker: PrefixTracker,
    ) -> None:
        await _sleep_until(self, start)
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
                record = RequestRecord(index=len(self.records), session=index, turn=turn,
                                       prompt_tokens=len(spec.prompt), max_tokens=spec.max_tokens,
                                       scheduled=scheduled if turn == 0 else None)  # fmt: skip
                self.records.append(record)
                record.ideal_cached_tokens = tracker.observe(spec.prompt)
                await self._send(http, spec, record)
                previous = record
            finally:
                if gate is not None:
                    gate.release()

    async def _send(self, http: aiohttp.ClientSession, spec: RequestSpec, record: RequestRecord) -> None:
        body = self.options.body(spec)
        record.start = self.now()
        try:
            await self._stream(http, body, record)
        except asyncio.TimeoutError:
            record.error, record.error_message = "timeout", f"no complete answer within {self.options.timeout}s"
        except aiohttp.ClientPayloadError as error:
            record.error, record.error_message = "stream_error", str(error)
        except aiohttp.ClientError as error:
            record.error, record.error_message = "connection", f"{type(error).__name__}: {error}"
        except (ValueError, KeyError, TypeError) as error:
            record.error, record.error_message = "bad_response", f"{type(error).__name__}: {error}"
        record.end = self.now()
        if self.on_done is not None:
            self.on_done(record)

    async def _stream(self, http: aiohttp.ClientSession, body: bytes, record: RequestRecord) -> None:
        url = self.options.base_url + "/v1/completions"
        async with http.post(url, data=body) as response:
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.error_message = (await response.text())[:500]
                return
            chunks, finished = 0, False
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    break
                arrived = self.now()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error, record.error_message = "stream_error", json.dumps(chunk["error"])[:500]
                    return
                choices = chunk.get("choices")
                if choices and choices[0].get("text"):
                    record.token_times.append(arrived)
                    chunks += 1
                if usage := chunk.get("usage"):
                    _read_usage(record, usage)
            if not finished:
                record.error, record.error_message = "incomplete_stream", "the stream ended without [DONE]"
            if record.output_tokens == 0:
                record.output_tokens = chunks


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


async def _sleep_until(client: LoadClient, start: float) -> None:
    delay = start - client.now()
    if delay > 0:
        await asyncio.sleep(delay)

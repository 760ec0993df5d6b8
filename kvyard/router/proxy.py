"""Forwards one request to one replica: pass-through streaming, and the router's accounting around it.

A failure before the first byte reaches the client (connection refused or reset, a replica answering
429/502/503/504, a stream that breaks before its first chunk) returns `RETRY`, so the caller can try
another replica; nothing has been sent to the client at that point. After the first byte the response
belongs to that replica. A client that goes away cancels the handler, which closes the upstream
connection, which is how the replica learns to stop.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web

from kvyard.router.metrics import RouterMetrics
from kvyard.router.policies import Decision
from kvyard.router.registry import Registry
from kvyard.router.replica import Replica

FirstByte = Callable[[], None]
RETRYABLE_STATUS: Final = frozenset({429, 502, 503, 504})
_FORWARDED_HEADERS: Final = ("authorization", "x-request-id", "openai-organization")
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class Retry:
    reason: str
    response: web.Response | None = None  # what to answer if no other replica is left


@dataclass(slots=True)
class Forwarder:
    session: aiohttp.ClientSession
    registry: Registry
    metrics: RouterMetrics
    connect_timeout_s: float

    async def forward(
        self, request: web.Request, path: str, raw: bytes, decision: Decision, stream: bool
    ) -> web.StreamResponse | Retry:
        replica = decision.replica
        replica.in_flight += 1
        replica.awaiting_first_byte += 1
        replica.pending_prefill_tokens += decision.prefill_tokens
        if decision.keys:
            replica.index.note_routed(decision.keys)
        self.metrics.routed.labels(replica.url).inc()
        first_byte = False

        def on_first_byte() -> None:
            nonlocal first_byte
            if not first_byte:
                first_byte = True
                replica.awaiting_first_byte -= 1
                replica.pending_prefill_tokens -= decision.prefill_tokens

        try:
            return await self._exchange(request, path, raw, decision, stream, on_first_byte)
        finally:
            on_first_byte()
            replica.in_flight -= 1

    async def _exchange(
        self, request: web.Request, path: str, raw: bytes, decision: Decision, stream: bool, on_first_byte: FirstByte
    ) -> web.StreamResponse | Retry:
        replica = decision.replica
        headers = {"Content-Type": "application/json"}
        for name in _FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        try:
            upstream = await self.session.post(f"{replica.url}{path}", data=raw, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.registry.report_failure(replica, "connect")
            return Retry("connect")
        try:
            if upstream.status in RETRYABLE_STATUS:
                body = await upstream.read()
                return Retry(f"status_{upstream.status}", _copy(upstream, body, replica))
            if stream and upstream.status == 200:
                return await self._stream(request, upstream, decision, on_first_byte)
            body = await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.registry.report_failure(replica, "broken_before_first_byte")
            return Retry("broken")
        finally:
            upstream.close()
        self._account_usage(decision, body)
        return _copy(upstream, body, replica)

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, decision: Decision, on_first_byte: FirstByte
    ) -> web.StreamResponse:
        first = await upstream.content.readany()  # may raise: nothing was sent yet, so the caller retries
        if not first:
            raise aiohttp.ClientPayloadError("stream ended before its first byte")
        on_first_byte()
        replica = decision.replica
        replica.streaming += 1
        response = web.StreamResponse(status=upstream.status, headers=_passed_headers(upstream, replica))
        try:
            await response.prepare(request)
            chunk = first
            while chunk:
                if b'"usage"' in chunk:
                    self._account_usage(decision, chunk)
                await response.write(chunk)
                chunk = await upstream.content.readany()
            await response.write_eof()
            return response
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return response  # the replica broke mid-stream: the client sees the stream end
        finally:
            replica.streaming -= 1

    def _account_usage(self, decision: Decision, body: bytes) -> None:
        cached = _CACHED_TOKENS.search(body)
        if cached is None:
            return
        url = decision.replica.url
        self.metrics.reported_cached.labels(url).inc(int(cached.group(1)))
        prompt = _PROMPT_TOKENS.search(body)
        if prompt is not None:
            self.metrics.prompt_tokens.labels(url).inc(int(prompt.group(1)))
        if decision.predicted_cached_tokens is not None:
            self.metrics.predicted_cached.labels(url).inc(decision.predicted_cached_tokens)


def _passed_headers(upstream: aiohttp.ClientResponse, replica: Replica) -> dict[str, str]:
    headers = {"X-Kvyard-Replica": replica.url}
    for name in ("Content-Type", "Retry-After", "Cache-Control"):
        value = upstream.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


def _copy(upstream: aiohttp.ClientResponse, body: bytes, replica: Replica) -> web.Response:
    return web.Response(body=body, status=upstream.status, headers=_passed_headers(upstream, replica))

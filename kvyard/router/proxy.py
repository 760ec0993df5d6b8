"""Forwards one request to one replica: pass-through streaming, and the router's accounting around it.

A failure before the first byte reaches the client (connection refused or reset, a replica answering
429/502/503/504, a stream that breaks before its first chunk) returns a `Retry`, so the caller can try
another replica; nothing has been sent to the client at that point. A stream that breaks later is
resumed on another replica when a `StreamFollower` follows it (one choice); otherwise, or when no
replica can take it, the client gets an error event and no [DONE], never a clean-looking end. A client
that goes away cancels the handler, which closes the upstream connection, which is how the replica
learns to stop.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

import orjson

from kvyard.api.errors import error_body
from kvyard.api.protocol import IGNORED_FIELDS_HEADER
from kvyard.net.http_client import ConnectError, HttpError, Response
from kvyard.net.http_server import HttpRequest, Responder
from kvyard.router.metrics import RouterMetrics
from kvyard.router.policies import CachedSplit, Decision
from kvyard.router.registry import Registry
from kvyard.router.replica import Replica
from kvyard.router.resume import Follower

FirstByte = Callable[[], None]
RETRYABLE_STATUS: Final = frozenset({429, 502, 503, 504})
# A client's Authorization never goes upstream: the router calls replicas with its own key (contract 8).
_FORWARDED_HEADERS: Final = ("x-request-id", "openai-organization")
_PASSED_HEADERS: Final = ("retry-after", "cache-control", IGNORED_FIELDS_HEADER.lower())
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_BY_SOURCE = re.compile(
    rb'"cached_tokens_by_source"\s*:\s*\{\s*"device"\s*:\s*(\d+)\s*,\s*"local"\s*:\s*(\d+)'
    rb'\s*,\s*"shared"\s*:\s*(\d+)'
)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A replica's refusal, kept to answer with if no other replica takes the request."""

    status: int
    body: bytes
    headers: list[tuple[str, str]]
    content_type: str


@dataclass(frozen=True, slots=True)
class Retry:
    reason: str
    response: StoredResponse | None = None


@dataclass(slots=True)
class _Relay:
    """Streams a 200 response to the client as its bytes arrive; the head goes out with the first byte."""

    responder: Responder
    replica: Replica
    on_first_byte: FirstByte
    on_usage: Callable[[bytes], None]
    follower: Follower | None = None
    content_type: str = "text/event-stream"
    started: bool = False  # this replica's answer reaches the client
    ignored_fields: str | None = None  # the replica's X-Kvyard-Ignored-Fields

    def on_head(self, response: Response) -> None:
        self.content_type = response.headers.get("content-type", self.content_type)
        self.ignored_fields = response.headers.get(IGNORED_FIELDS_HEADER.lower())

    def on_body(self, data: bytes, arrived: float) -> None:
        self.replica.answered_at = arrived
        if self.follower is not None:
            data = self.follower.feed(data)
            if not data:
                return
        first = not self.started
        if first:
            self.started = True
            self.replica.streaming += 1
            if not self.responder.started:  # a resumed stream's head went out with the first replica's bytes
                headers = [("Content-Type", self.content_type), ("X-Kvyard-Replica", self.replica.url)]
                if self.content_type.startswith("text/event-stream"):
                    headers.append(("Cache-Control", "no-cache"))  # proxies must not hold a stream back
                if self.ignored_fields:
                    headers.append((IGNORED_FIELDS_HEADER, self.ignored_fields))
                self.responder.start(200, headers)
        self.responder.write(data)
        if first:  # the client's first token goes out before the router's accounting
            self.on_first_byte()
        if b'"usage"' in data:
            self.on_usage(data)


@dataclass(slots=True)
class Forwarder:
    registry: Registry
    metrics: RouterMetrics

    async def forward(
        self,
        request: HttpRequest,
        responder: Responder,
        path: str,
        decision: Decision,
        stream: bool,
        body: bytes,
        follower: Follower | None = None,
    ) -> Retry | None:
        """Proxy the request (`body`: what the replica gets) to the decided replica; None once the client has
        its answer. `follower` follows a stream that another replica may have to resume."""
        replica = decision.replica
        replica.in_flight += 1
        replica.awaiting_first_byte += 1
        replica.pending_prefill_cost += decision.prefill_cost
        replica.pending_load_s += decision.load_s
        replica.pending_kv_tokens += decision.kv_tokens
        # Held until the first byte, see CacheIndex
        batch = replica.index.note_routed(decision.keys, math.inf) if decision.keys else None
        self.metrics.replica(replica.url).routed.inc()
        first_byte = False

        def on_first_byte() -> None:
            nonlocal first_byte
            if not first_byte:
                first_byte = True
                replica.awaiting_first_byte -= 1
                replica.first_bytes_since_load += 1
                replica.pending_prefill_cost -= decision.prefill_cost
                replica.pending_load_s -= decision.load_s
                replica.pending_kv_tokens -= decision.kv_tokens
                if batch is not None:
                    replica.index.stamp(batch)

        sent = time.monotonic()

        def on_first_chunk() -> None:  # of a stream: its time to first token calibrates the replica's speed
            if not first_byte:
                work = decision.prefill_ahead + decision.prefill_cost
                replica.ttft.observe(work, decision.running, time.monotonic() - sent)
            on_first_byte()

        relay = _Relay(responder, replica, on_first_chunk, lambda body: self._account_usage(decision, body), follower)
        if follower is not None:
            follower.start_attempt()
        try:
            return await self._exchange(request, responder, path, decision, body, relay if stream else None)
        finally:
            on_first_byte()
            replica.in_flight -= 1
            if relay.started:
                replica.streaming -= 1

    async def _exchange(
        self,
        request: HttpRequest,
        responder: Responder,
        path: str,
        decision: Decision,
        body: bytes,
        relay: _Relay | None,
    ) -> Retry | None:
        replica = decision.replica
        headers = {"Content-Type": "application/json", **replica.api_headers, **(decision.headers or {})}
        for name in _FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        try:
            response = await replica.http.request(
                "POST",
                path,
                body,
                headers=headers,
                sink=relay.on_body if relay else None,
                on_head=relay.on_head if relay else None,
            )
        except ConnectError:
            self.registry.report_failure(replica, "connect")
            return Retry("connect")
        except HttpError as error:
            if not responder.started:
                self.registry.report_failure(replica, "broken_before_first_byte")
                return Retry("broken")
            self.registry.report_failure(replica, "broken_mid_stream")
            return self._broken_mid_stream(responder, relay.follower if relay else None, str(error))
        if responder.started and relay is not None and relay.started:
            responder.end()
            return None
        body = bytes(response.body)
        if response.status in RETRYABLE_STATUS:
            return Retry(f"status_{response.status}", _stored(response, body, replica))
        if responder.started:  # a replica refused to resume a stream: the client learns why
            end_broken_stream(responder, _replica_refusal(body))
            return None
        if relay is None and response.status == 200:
            replica.answered_at = time.monotonic()
            self._account_usage(decision, body)
        stored = _stored(response, body, replica)
        responder.send(stored.status, stored.body, stored.headers, stored.content_type)
        return None

    def prefill(self, decision: Decision, path: str, body: bytes) -> Coroutine[Any, Any, None]:
        """The prefill leg of a disaggregated request: its answer (one token) is not the client's, but the
        replica's queue, cache index and health are accounted as for any request. A failure only counts: the
        decode replica, finding nothing to pull, computes the prompt itself.

        The leg is accounted on the replica now, when it is decided, and sent when the returned coroutine runs
        (the caller makes it a task): the next request of a burst, decided before that task first runs, must
        see this leg's prefill queued, or a whole burst lands on whichever replica looked idle."""
        replica = decision.replica
        replica.in_flight += 1
        replica.awaiting_first_byte += 1
        replica.pending_prefill_cost += decision.prefill_cost
        replica.pending_load_s += decision.load_s
        batch = replica.index.note_routed(decision.keys, math.inf) if decision.keys else None
        self.metrics.replica(replica.url).routed.inc()
        return self._send_prefill(decision, path, body, batch)

    async def _send_prefill(self, decision: Decision, path: str, body: bytes, batch: int | None) -> None:
        replica = decision.replica
        outcome = "ok"
        try:
            headers = {"Content-Type": "application/json", **replica.api_headers, **(decision.headers or {})}
            response = await replica.http.request("POST", path, body, headers=headers)
            if response.status != 200:
                outcome = f"status_{response.status}"
        except ConnectError:
            self.registry.report_failure(replica, "connect")
            outcome = "connect"
        except HttpError:
            self.registry.report_failure(replica, "broken_before_first_byte")
            outcome = "broken"
        finally:
            replica.in_flight -= 1
            replica.awaiting_first_byte -= 1
            replica.first_bytes_since_load += 1
            replica.pending_prefill_cost -= decision.prefill_cost
            replica.pending_load_s -= decision.load_s
            if batch is not None:
                replica.index.stamp(batch)
            self.metrics.pd_prefills.labels(outcome).inc()

    def _broken_mid_stream(self, responder: Responder, follower: Follower | None, reason: str) -> Retry | None:
        if follower is not None and follower.answered:  # only the usage chunk is missing
            responder.write(b"data: [DONE]\n\n")
            responder.end()
            return None
        if follower is not None and follower.resumable:
            return Retry("broken_mid_stream")
        end_broken_stream(responder, f"the replica serving this stream failed mid-stream ({reason})")
        return None

    def _account_usage(self, decision: Decision, body: bytes) -> None:
        cached = _CACHED_TOKENS.search(body)
        if cached is None:
            return
        replica_metrics = self.metrics.replica(decision.replica.url)
        reported = int(cached.group(1))
        replica_metrics.reported_cached.inc(reported)
        prompt = _PROMPT_TOKENS.search(body)
        if prompt is not None:
            replica_metrics.prompt_tokens.inc(int(prompt.group(1)))
        if decision.predicted_cached_tokens is not None:
            replica_metrics.predicted_cached.inc(decision.predicted_cached_tokens)
            replica_metrics.cached_error.inc(abs(decision.predicted_cached_tokens - reported))
        by_source = _BY_SOURCE.search(body)
        if by_source is not None and decision.predicted_split is not None:
            split = CachedSplit(*(int(group) for group in by_source.groups()))
            self._account_sources(decision, decision.predicted_split, split)

    def _account_sources(self, decision: Decision, predicted: CachedSplit, reported: CachedSplit) -> None:
        replica_metrics = self.metrics.replica(decision.replica.url)
        for (source, want), got in zip(predicted.as_dict().items(), reported.as_dict().values()):
            replica_metrics.predicted_by_source[source].inc(want)
            replica_metrics.reported_by_source[source].inc(got)
            replica_metrics.error_by_source[source].inc(abs(want - got))
        if reported.shared < predicted.shared and decision.keys and decision.replica.namespace is not None:
            # Blocks the store no longer holds though no replica saw them go (its own eviction, TTL): forget them.
            size = decision.replica.namespace.block_size
            start = (predicted.device + predicted.local + reported.shared) // size
            end = predicted.total // size
            self.registry.shared_stores.forget_after(decision.replica.shared_store_id, decision.keys[start:end])


def end_broken_stream(responder: Responder, reason: str) -> None:
    """End a stream that cannot be completed with an error event and no [DONE] (clients raise on it)."""
    payload = error_body(502, f"{reason}; the answer is incomplete", code="replica_failed")
    responder.write(b"data: " + orjson.dumps(payload) + b"\n\n")
    responder.end()


def _replica_refusal(body: bytes) -> str:
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return f"no replica could resume this stream ({message})"


def _stored(response: Response, body: bytes, replica: Replica) -> StoredResponse:
    headers = [("X-Kvyard-Replica", replica.url)]
    headers += [(name.title(), response.headers[name]) for name in _PASSED_HEADERS if name in response.headers]
    content_type = response.headers.get("content-type", "application/json")
    return StoredResponse(response.status, body, headers, content_type)

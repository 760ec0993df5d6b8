"""The router's HTTP API: the OpenAI endpoints of a replica, plus `/admin/replicas` to change the fleet."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvyard.router.config import RouterConfig
from kvyard.router.metrics import RouterMetrics
from kvyard.router.policies import Policy, RouteRequest, make_policy
from kvyard.router.proxy import Forwarder, Retry
from kvyard.router.registry import Registry
from kvyard.router.replica import Replica
from kvyard.router.tokens import Tokenizer
from kvyard.server.errors import APIError, bad_request, error_body

_LOG = logging.getLogger(__name__)
ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")


@dataclass(slots=True)
class Router:
    config: RouterConfig
    metrics: RouterMetrics
    session: aiohttp.ClientSession
    registry: Registry
    policy: Policy
    tokenizer: Tokenizer
    forwarder: Forwarder
    in_flight: int = 0

    @classmethod
    def create(cls, config: RouterConfig) -> Router:
        metrics = RouterMetrics()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        registry = Registry(config, metrics, session)
        forwarder = Forwarder(session, registry, metrics, config.connect_timeout_s)
        tokenizer = Tokenizer(session, config.tokenize_cache_entries)
        return cls(config, metrics, session, registry, make_policy(config), tokenizer, forwarder)

    async def close(self) -> None:
        await self.registry.close()
        await self.session.close()

    def candidates(self, model: str | None, exclude: set[str]) -> list[Replica]:
        return [
            replica
            for replica in self.registry.routable()
            if replica.url not in exclude and (model is None or not replica.model_ids or model in replica.model_ids)
        ]

    async def route(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        raw = await request.read()
        body = _parse_request(raw, kind)
        if self.in_flight >= self.config.max_in_flight:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, f"router queue is full ({self.in_flight} requests in flight); retry later",
                           code="overloaded", retry_after=1)  # fmt: skip
        model = body.get("model")
        self._check_model(model)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            return await self._attempts(request, kind, path, raw, body, model)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    async def _attempts(
        self, request: web.Request, kind: str, path: str, raw: bytes, body: dict[str, Any], model: str | None
    ) -> web.StreamResponse:
        tried: set[str] = set()
        last: Retry | None = None
        route_request: RouteRequest | None = None
        for _ in range(self.config.max_attempts):
            candidates = self.candidates(model, tried)
            if not candidates:
                break
            if route_request is None:
                route_request = await self._route_request(request, kind, body, candidates)
            started = time.perf_counter()
            decision = self.policy.choose(route_request, candidates)
            self.metrics.decision_latency.observe(time.perf_counter() - started)
            tried.add(decision.replica.url)
            outcome = await self.forwarder.forward(request, path, raw, decision, body.get("stream") is True)
            if not isinstance(outcome, Retry):
                return outcome
            last = outcome
            self.metrics.retries.labels(outcome.reason).inc()
        if last is not None and last.response is not None:
            return last.response
        self.metrics.rejected.labels("no_replica").inc()
        raise APIError(503, "no healthy replica could take the request; retry later", code="no_replica",
                       retry_after=1)  # fmt: skip

    async def _route_request(
        self, request: web.Request, kind: str, body: dict[str, Any], candidates: list[Replica]
    ) -> RouteRequest:
        session_key = request.headers.get(self.config.session_header) or body.get("user")
        token_ids = None
        if self.config.policy == "cache_aware":
            token_ids = await self.tokenizer.token_ids(kind, body, candidates)
        salt = body.get("cache_salt")
        return RouteRequest(kind, body, str(session_key) if session_key else None, token_ids,
                            salt if isinstance(salt, str) else None)  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = {model_id for replica in self.registry.replicas.values() for model_id in replica.model_ids}
        if known and model not in known:
            raise APIError(404, f"model {model!r} is not served here; available: {', '.join(sorted(known))}",
                           param="model", code="model_not_found")  # fmt: skip


def _parse_request(raw: bytes, kind: str) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise bad_request(f"request body is not valid JSON: {error}", "body") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "body")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise bad_request("'stream' must be true or false", "stream")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of messages", "messages")
    elif not isinstance(body.get("prompt"), (str, list)) or body.get("prompt") == []:
        raise bad_request("'prompt' is required: a string, a list of strings or a list of token ids", "prompt")
    return body


# ---------------------------------------------------------------------------- HTTP handlers


def create_app(config: RouterConfig, replica_urls: list[str]) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=64 << 20)

    async def start(app: web.Application) -> None:
        router = Router.create(config)
        for url in replica_urls:
            router.registry.add(url)
        app[ROUTER_KEY] = router

    async def stop(app: web.Application) -> None:
        await app[ROUTER_KEY].close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.add_routes([
        web.post("/v1/completions", _completions),
        web.post("/v1/chat/completions", _chat_completions),
        web.get("/v1/models", _models),
        web.get("/health", _health),
        web.get("/metrics", _metrics),
        web.get("/admin/replicas", _list_replicas),
        web.post("/admin/replicas", _add_replica),
        web.post("/admin/replicas/drain", _drain_replica),
        web.delete("/admin/replicas", _remove_replica),
    ])  # fmt: skip
    return app


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except APIError as error:
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
        return web.json_response(error_body(error.status, error.message, error.param, error.code),
                                 status=error.status, headers=headers)  # fmt: skip
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return web.json_response(error_body(error.status, f"{request.method} {request.path}: {error.reason}"),
                                 status=error.status)  # fmt: skip


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER_KEY].route(request, "completion", "/v1/completions")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[ROUTER_KEY].route(request, "chat", "/v1/chat/completions")


async def _models(request: web.Request) -> web.Response:
    registry = request.app[ROUTER_KEY].registry
    ids = sorted({model_id for replica in registry.replicas.values() for model_id in replica.model_ids})
    cards = [{"id": model_id, "object": "model", "owned_by": "kvyard"} for model_id in ids]
    return web.json_response({"object": "list", "data": cards})


async def _health(request: web.Request) -> web.Response:
    if not request.app[ROUTER_KEY].registry.routable():
        raise APIError(503, "no healthy replica", code="no_replica", retry_after=1)
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _list_replicas(request: web.Request) -> web.Response:
    replicas = request.app[ROUTER_KEY].registry.replicas.values()
    return web.json_response({"replicas": [replica.describe() for replica in replicas]})


async def _admin_url(request: web.Request) -> str:
    url = request.query.get("url")
    if url is None and request.can_read_body:
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("request body is not valid JSON", "url") from None
        url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url:
        raise bad_request("give the replica as {'url': 'http://host:port'}", "url")
    return url


async def _add_replica(request: web.Request) -> web.Response:
    url = await _admin_url(request)
    try:
        replica = request.app[ROUTER_KEY].registry.add(url)
    except ValueError as error:
        raise bad_request(str(error), "url") from None
    return web.json_response(replica.describe())


async def _drain_replica(request: web.Request) -> web.Response:
    url = await _admin_url(request)
    try:
        return web.json_response(request.app[ROUTER_KEY].registry.drain(url).describe())
    except KeyError:
        raise APIError(404, f"no replica {url!r}", param="url", code="replica_not_found") from None


async def _remove_replica(request: web.Request) -> web.Response:
    url = await _admin_url(request)
    try:
        replica = await request.app[ROUTER_KEY].registry.remove(url)
    except KeyError:
        raise APIError(404, f"no replica {url!r}", param="url", code="replica_not_found") from None
    return web.json_response(replica.describe())

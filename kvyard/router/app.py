"""The router's HTTP API: the OpenAI endpoints of a replica, plus `/admin/replicas` to change the fleet.

Served by kvyard's own small HTTP server (`kvyard.net`) rather than a web framework: every request of
the fleet passes through here, so the router's CPU per request bounds the fleet's request rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvyard import __version__
from kvyard.api.auth import Access, AdminKey, KeySet, bearer_token, tenant_salt
from kvyard.api.engine_kv_events import EventEndpoints
from kvyard.api.errors import APIError, bad_request, error_body
from kvyard.api.load import LoadReport
from kvyard.api.openapi import openapi_document
from kvyard.api.protocol import json_object
from kvyard.api.ratelimit import RateLimiter
from kvyard.net.http_client import ConnectError, HttpError
from kvyard.net.http_server import HttpRequest, HttpServer, Responder, method_endpoint, under_prefix
from kvyard.router.config import RouterConfig
from kvyard.router.engine_probe import KVYARD, VLLM
from kvyard.router.metrics import RouterMetrics
from kvyard.router.pd import PREFILL, PDPlan, PDPlanner, prefill_leg
from kvyard.router.policies import CacheAware, Decision, Policy, RouteRequest, make_policy
from kvyard.router.proxy import Forwarder, Retry, end_broken_stream
from kvyard.router.registry import Registry, UpstreamAuth
from kvyard.router.replica import ModelCard, Replica
from kvyard.router.resume import Follower, StreamFollower
from kvyard.router.token_resume import TokenFollower
from kvyard.router.tokens import Tokenizer, estimated_tokens_asked

_LOG = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 30.0


@dataclass(slots=True)
class Router:
    config: RouterConfig
    metrics: RouterMetrics
    registry: Registry
    policy: Policy
    tokenizer: Tokenizer
    forwarder: Forwarder
    keys: KeySet
    admin_key: AdminKey
    limiter: RateLimiter
    planner: PDPlanner
    in_flight: int = 0
    _prefill_legs: set[asyncio.Task[None]] = field(default_factory=set)
    _candidates: tuple[list[Replica], str | None, list[Replica]] | None = None  # (routable, model, candidates)
    _has_prefill: tuple[list[Replica], bool] | None = None  # (candidates, whether a prefill replica is among them)

    @classmethod
    def create(cls, config: RouterConfig) -> Router:
        metrics = RouterMetrics()
        registry = Registry(config, metrics, UpstreamAuth.from_config(config))
        forwarder = Forwarder(registry, metrics)
        tokenizer = Tokenizer(config.tokenize_cache_entries)
        keys = KeySet.from_settings(config.access.api_keys, config.access.api_keys_file)
        admin_key = AdminKey.from_settings(config.access.admin_key)
        limiter = RateLimiter(config.access.requests_per_min, config.access.tokens_per_min)
        shared, holders = registry.shared_stores, registry.holders
        return cls(
            config,
            metrics,
            registry,
            make_policy(config, shared, holders),
            tokenizer,
            forwarder,
            keys,
            admin_key,
            limiter,
            PDPlanner.create(config, shared, holders),
        )

    async def close(self) -> None:
        await self.registry.close()

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        """The HTTP server's entry point: dispatch, and turn APIError into an OpenAI-style error."""
        try:
            methods = _ROUTES.get(request.path) or under_prefix(_PREFIX_ROUTES, request.path)
            if methods is None:
                raise APIError(404, f"{request.method} {request.path}: not found", code="not_found")
            endpoint = method_endpoint(methods, request.method)
            if endpoint is None:
                raise APIError(405, f"{request.method} {request.path}: method not allowed", code="method_not_allowed")
            self._authorize(request)
            await endpoint(self, request, responder)
        except APIError as error:
            if responder.started:
                responder.abort()
                return
            headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
            responder.send_json(error.status, error_body(error.status, error.message, error.param, error.code), headers)

    def _authorize(self, request: HttpRequest) -> None:
        access = _ACCESS.get(request.path, Access.API)
        if access is Access.PUBLIC and request.path == "/metrics" and self.config.access.metrics_need_key:
            access = Access.API
        if access is Access.API:
            self.keys.authenticate(request.headers)
        elif access is Access.ADMIN:
            self.admin_key.authorize(request.headers, request.path)

    def reload_keys(self) -> None:
        """Read the API-key file again (SIGHUP); on failure the keys in force stay."""
        try:
            self.keys.reload()
        except OSError as error:
            _LOG.error("cannot read the API-key file, keeping the current keys: %s", error)

    def candidates(self, model: str | None, exclude: set[str], kinds: frozenset[str] | None = None) -> list[Replica]:
        """Routable replicas (Registry.routable) serving `model`, less `exclude`, of one of `kinds` if given (one
        list object per state of the fleet and model, so a policy can keep lookups over it)."""
        routable = self.registry.routable()
        cached = self._candidates
        if not exclude and kinds is None and cached is not None and cached[0] is routable and cached[1] == model:
            return cached[2]
        chosen = [
            replica
            for replica in routable
            if replica.url not in exclude
            and (model is None or not replica.model_ids or model in replica.model_ids)
            and (kinds is None or replica.kind in kinds)
        ]
        if not exclude and kinds is None:
            self._candidates = (routable, model, chosen)
        return chosen

    async def route(self, request: HttpRequest, responder: Responder, kind: str, path: str) -> None:
        caller = self.keys.authenticate(request.headers) or bearer_token(request.headers) or request.peer
        body = _parse_request(request.body, kind)
        self.limiter.admit(caller, estimated_tokens_asked(kind, body) if self.limiter.tokens_per_min else 0)
        if self.in_flight >= self.config.max_in_flight:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(
                429,
                f"router queue is full ({self.in_flight} requests in flight); retry later",
                code="overloaded",
                retry_after=1,
            )
        model = body.get("model")
        self._check_model(model)
        upstream_body = self._with_tenant_salt(request, body)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            await self._attempts(request, responder, kind, path, body, model, upstream_body)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()

    def _with_tenant_salt(self, request: HttpRequest, body: dict[str, Any]) -> bytes:
        """The body replicas get: as sent, or (caches split by key) with the caller's tenant salt in cache_salt."""
        if not self.config.access.cache_salt_per_api_key:
            return request.body
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise bad_request("'cache_salt' must be a string", "cache_salt")
        caller = self.keys.authenticate(request.headers) or bearer_token(request.headers)
        body["cache_salt"] = tenant_salt(caller, salt, per_key=True)
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:  # nested deeper than orjson writes (254 levels), though it reads 1,024
            raise bad_request("request body is nested too deeply", "body") from None

    async def _attempts(
        self,
        request: HttpRequest,
        responder: Responder,
        kind: str,
        path: str,
        body: dict[str, Any],
        model: str | None,
        upstream_body: bytes,
    ) -> None:
        tried: set[str] = set()
        last: Retry | None = None
        stream = body.get("stream") is True
        follower: Follower | None = None
        route_request: RouteRequest | None = None
        for _ in range(self.config.max_attempts):
            resuming = follower is not None and follower.relayed
            candidates = self.candidates(model, tried, follower.kinds if follower is not None and resuming else None)
            if not candidates:
                break
            disaggregate = self._disaggregated(candidates) and not resuming
            if route_request is None:
                route_request = await self._route_request(request, kind, body, candidates, disaggregate)
            started = time.perf_counter()
            if disaggregate:
                decision, attempt = self._plan_pd(kind, path, body, route_request, candidates)
            else:
                decision, attempt = self.policy.choose(route_request, candidates), body
            self.metrics.decision_latency.observe(time.perf_counter() - started)
            if not disaggregate and _LOG.isEnabledFor(logging.DEBUG):
                _LOG.debug(_describe_decision(decision, route_request, self.policy))
            replica = decision.replica
            tried.add(replica.url)
            if stream and not resuming:  # how a broken stream resumes depends on the replica that serves it
                follower = _follower(kind, body, replica)
            attempt = _with_engine_fields(replica, attempt)
            if follower is not None:
                attempt_body = follower.upstream_body(attempt)
            else:
                attempt_body = upstream_body if attempt is body else orjson.dumps(attempt)
            attempt_path = follower.upstream_path(path) if follower is not None else path
            outcome = await self.forwarder.forward(
                request, responder, attempt_path, decision, stream, attempt_body, follower
            )
            if outcome is None:
                return
            last = outcome
            self.metrics.retries.labels(outcome.reason).inc()
        if responder.started:
            end_broken_stream(responder, "the replica serving this stream failed and no replica could resume it")
            return
        if last is not None and last.response is not None:
            stored = last.response
            responder.send(stored.status, stored.body, stored.headers, stored.content_type)
            return
        self.metrics.rejected.labels("no_replica").inc()
        raise APIError(503, "no healthy replica could take the request; retry later", code="no_replica", retry_after=1)

    def _disaggregated(self, candidates: list[Replica]) -> bool:
        """Prefill replicas are among the candidates, and the router holds the admin key PD legs need (for them)."""
        # Once per candidate list, not per request: the registry makes a new list when a role changes.
        if self._has_prefill is None or self._has_prefill[0] is not candidates:
            self._has_prefill = (candidates, any(r.role == PREFILL and r.pd_headers for r in candidates))
        return self._has_prefill[1]

    def _plan_pd(
        self, kind: str, path: str, body: dict[str, Any], route_request: RouteRequest, candidates: list[Replica]
    ) -> tuple[Decision, dict[str, Any]]:
        """The decode replica's decision and body; the prefill leg, when there is one, is already on its way."""
        plan = self.planner.plan(route_request, candidates)
        self.metrics.pd_routes.labels(plan.reason).inc()
        if _LOG.isEnabledFor(logging.DEBUG):
            _LOG.debug(_describe_plan(plan, route_request))
        if plan.prefill is None:
            return plan.decode, body
        self._send_prefill_leg(kind, path, body, plan)
        plan.decode.headers = plan.decode.replica.pd_headers
        plan.decode.prefill_cost = 0.0  # it pulls the prompt's blocks, computing only the last few tokens
        return plan.decode, {**body, "kv_transfer_params": plan.decode_fields()}

    def _send_prefill_leg(self, kind: str, path: str, body: dict[str, Any], plan: PDPlan) -> None:
        assert plan.prefill is not None
        plan.prefill.headers = plan.prefill.replica.pd_headers
        leg = orjson.dumps(prefill_leg(kind, body, plan.transfer_id, plan.transfer_token))
        task = asyncio.create_task(self.forwarder.prefill(plan.prefill, path, leg))
        self._prefill_legs.add(task)
        task.add_done_callback(self._prefill_legs.discard)

    async def _route_request(
        self, request: HttpRequest, kind: str, body: dict[str, Any], candidates: list[Replica], disaggregate: bool
    ) -> RouteRequest:
        session_key = request.headers.get(self.config.session_header) or body.get("user")
        token_ids = None
        if self.config.policy == "cache_aware" or disaggregate:
            token_ids = await self.tokenizer.token_ids(kind, body, candidates)
        salt = body.get("cache_salt")
        return RouteRequest(
            kind, body, str(session_key) if session_key else None, token_ids, salt if isinstance(salt, str) else None
        )

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = {model_id for replica in self.registry.replicas.values() for model_id in replica.model_ids}
        if known and model not in known:
            raise APIError(
                404,
                f"model {model!r} is not served here; available: {', '.join(sorted(known))}",
                param="model",
                code="model_not_found",
            )


def _follower(kind: str, body: dict[str, Any], replica: Replica) -> Follower | None:
    """What follows a stream on `replica` so that another replica can finish it: kvyard's replicas resume from
    progress lines, vLLM's from token ids; another server's stream is not resumed (a failure ends it with an
    error event)."""
    if replica.kind == KVYARD:
        return StreamFollower.for_request(kind, body)
    if replica.kind == VLLM:
        limits = [card.max_model_len for card in replica.model_cards if card.id == body.get("model")]
        return TokenFollower.for_request(kind, body, limits[0] if limits else None)
    return None


def _with_engine_fields(replica: Replica, body: dict[str, Any]) -> dict[str, Any]:
    """What the replica's engine needs beyond the client's request: while the router's index of a vLLM replica is
    known to miss blocks (engine_sync), the replica also announces the cached blocks each request reuses, so the
    index learns them back (it costs the engine an event per request, so only then)."""
    if replica.kind != VLLM or not replica.index.has_events or time.monotonic() > replica.report_reuse_until:
        return body
    xargs = body.get("vllm_xargs")
    return {**body, "vllm_xargs": {**(xargs if isinstance(xargs, dict) else {}), "kv_cache_report_mode": "full"}}


def _describe_decision(decision: Decision, request: RouteRequest, policy: Policy) -> str:
    """One routing decision, for `--log-level debug`: where, and what the replica held and had queued then."""
    tokens = len(request.token_ids) if request.token_ids is not None else None
    weighs = f" (each {policy.running_cost(decision.replica):.0f})" if isinstance(policy, CacheAware) else ""
    return (
        f"route: session {request.session_key} prompt {tokens} tokens -> {decision.replica.url} cached "
        f"{decision.predicted_cached_tokens} cost {decision.prefill_cost:.0f} ahead {decision.prefill_ahead:.0f} "
        f"running {decision.running}{weighs} in flight {decision.replica.in_flight} conversations {decision.homed}"
    )


def _describe_plan(plan: PDPlan, request: RouteRequest) -> str:
    """One PD decision, for `--log-level debug`: why, where, and what each side was predicted to hold."""
    tokens = len(request.token_ids) if request.token_ids is not None else None
    decode, prefill = plan.decode, plan.prefill
    remote = f" prefill {prefill.replica.url} cached {prefill.predicted_cached_tokens}" if prefill else ""
    return (
        f"pd {plan.reason}: session {request.session_key} prompt {tokens} tokens; decode {decode.replica.url} "
        f"cached {decode.predicted_cached_tokens} cost {decode.prefill_cost:.0f} load {decode.load_s:.3f}s"
        f"{remote}"
    )


def _parse_request(raw: bytes, kind: str) -> dict[str, Any]:
    body = json_object(raw)
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


# ---------------------------------------------------------------------------- endpoints

Endpoint = Callable[[Router, HttpRequest, Responder], Awaitable[None]]


async def _completions(router: Router, request: HttpRequest, responder: Responder) -> None:
    await router.route(request, responder, "completion", "/v1/completions")


async def _chat_completions(router: Router, request: HttpRequest, responder: Responder) -> None:
    await router.route(request, responder, "chat", "/v1/chat/completions")


async def _models(router: Router, request: HttpRequest, responder: Responder) -> None:
    by_id: dict[str, list[ModelCard]] = {}
    for replica in router.registry.replicas.values():
        for card in replica.model_cards:
            by_id.setdefault(card.id, []).append(card)
    responder.send_json(200, {"object": "list", "data": [_fleet_card(by_id[i]) for i in sorted(by_id)]})


async def _model(router: Router, request: HttpRequest, responder: Responder) -> None:
    """GET /v1/models/{id}: the model as the fleet serves it, or a 404."""
    model = unquote(request.path.removeprefix(MODELS_PREFIX))
    cards = [card for replica in router.registry.replicas.values() for card in replica.model_cards if card.id == model]
    if not cards:
        raise APIError(404, f"the model '{model}' does not exist", "model", "model_not_found")
    responder.send_json(200, _fleet_card(cards))


def _fleet_card(cards: list[ModelCard]) -> dict[str, Any]:
    """One model as the fleet serves it: created when its first replica was, and the context every replica
    serving it can hold (the smallest)."""
    created = [card.created for card in cards if card.created is not None]
    lengths = [card.max_model_len for card in cards if card.max_model_len is not None]
    owners = [card.owned_by for card in cards if card.owned_by]
    body: dict[str, Any] = {
        "id": cards[0].id,
        "object": "model",
        "created": min(created, default=0),
        "owned_by": owners[0] if owners else "kvyard",
    }
    if lengths:
        body["max_model_len"] = min(lengths)
    return body


async def _tokenize(router: Router, request: HttpRequest, responder: Responder) -> None:
    await _to_one_replica(router, request, responder, "/tokenize")


async def _detokenize(router: Router, request: HttpRequest, responder: Responder) -> None:
    await _to_one_replica(router, request, responder, "/detokenize")


async def _to_one_replica(
    router: Router, request: HttpRequest, responder: Responder, path: str, upstream_body: bytes | None = None
) -> None:
    """A request any replica of the model answers alike (tokens, embeddings): to the least busy one, its answer
    as it is. `upstream_body`: what to send instead of the request's body."""
    body = json_object(request.body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    router._check_model(model)
    candidates = router.candidates(model, set())
    if not candidates:
        raise APIError(503, "no healthy replica", code="no_replica", retry_after=1)
    replica = min(candidates, key=lambda candidate: candidate.in_flight)
    headers = {"Content-Type": "application/json", **replica.api_headers}
    sent = request.body if upstream_body is None else upstream_body
    replica.in_flight += 1
    try:
        response = await replica.http.request("POST", path, sent, headers=headers)
    except (ConnectError, HttpError) as error:
        raise APIError(502, f"replica {replica.url} did not answer: {error}", code="replica_error") from None
    finally:
        replica.in_flight -= 1
    content_type = response.headers.get("content-type", "application/json")
    responder.send(response.status, bytes(response.body), [("X-Kvyard-Replica", replica.url)], content_type)


async def _pooling(router: Router, request: HttpRequest, responder: Responder) -> None:
    """Embeddings, rerank and score: one replica computes the whole request (the least busy), with the caller's
    tenant salt and the router's limits, as a completion would be."""
    caller = router.keys.authenticate(request.headers) or bearer_token(request.headers) or request.peer
    router.limiter.admit(caller, 0)
    if router.in_flight >= router.config.max_in_flight:
        router.metrics.rejected.labels("queue_full").inc()
        raise APIError(
            429,
            f"router queue is full ({router.in_flight} requests in flight); retry later",
            code="overloaded",
            retry_after=1,
        )
    body = json_object(request.body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    router._check_model(model)
    upstream_body = router._with_tenant_salt(request, body)
    router.in_flight += 1
    router.metrics.in_flight.inc()
    try:
        await _to_one_replica(router, request, responder, request.path, upstream_body)
    finally:
        router.in_flight -= 1
        router.metrics.in_flight.dec()


async def _version(router: Router, request: HttpRequest, responder: Responder) -> None:
    responder.send_json(200, {"version": __version__})


async def _health(router: Router, request: HttpRequest, responder: Responder) -> None:
    if not router.registry.healthy_count():
        raise APIError(503, "no healthy replica", code="no_replica", retry_after=1)
    responder.send_json(200, {"status": "ok"})


async def _load(router: Router, request: HttpRequest, responder: Responder) -> None:
    """The fleet's load as one report, summed over the replicas routed to (a router in front of routers, or
    `kvyard bench`, reads a router as it reads a replica); speeds are the replicas' median, since one request runs
    on one replica."""
    loads = [replica.load for replica in router.registry.routable()]
    speeds = sorted(load.prefill_s_per_token for load in loads if load.prefill_s_per_token > 0)
    report = LoadReport(
        num_waiting=sum(load.num_waiting for load in loads),
        num_running=sum(load.num_running for load in loads),
        in_flight_requests=router.in_flight,
        kv_blocks_used=sum(load.kv_blocks_used for load in loads),
        kv_blocks_total=sum(load.kv_blocks_total for load in loads),
        tokens_in_flight=sum(load.tokens_in_flight for load in loads),
        prefill_s_per_token=speeds[len(speeds) // 2] if speeds else 0.0,
    )
    responder.send_json(200, report.to_json())


async def _openapi(router: Router, request: HttpRequest, responder: Responder) -> None:
    paths = (
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/v1/rerank",
        "/score",
        "/v1/models",
        "/health",
        "/version",
    )
    responder.send_json(200, openapi_document(__version__, paths))


async def _metrics(router: Router, request: HttpRequest, responder: Responder) -> None:
    responder.send(200, generate_latest(router.metrics.registry), content_type=CONTENT_TYPE_LATEST)


async def _list_replicas(router: Router, request: HttpRequest, responder: Responder) -> None:
    registry = router.registry
    stores = {store_id: len(index) for store_id, index in registry.shared_stores.stores.items()}
    replicas = [replica.describe() for replica in registry.replicas.values()]
    responder.send_json(200, {"replicas": replicas, "shared_stores": stores})


def _admin_url(request: HttpRequest) -> str:
    return _admin_fields(request)[0]


def _admin_fields(request: HttpRequest) -> tuple[str, EventEndpoints | None, UpstreamAuth]:
    """The replica's URL (query or body) and, from the body, where it publishes KV events (vLLM, SGLang) and the
    keys it is sent: those given with it (`api_key`, `admin_key`), never the router's configured ones, which go
    only to the replicas it was started with."""
    url: Any = parse_qs(request.query).get("url", [None])[0]
    body: Any = {}
    if request.body:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            raise bad_request("request body is not valid JSON", "url") from None
    fields = body if isinstance(body, dict) else {}
    url = fields.get("url") if url is None else url
    if not isinstance(url, str) or not url:
        raise bad_request("give the replica as {'url': 'http://host:port'}", "url")
    for name, form in (("events", ": tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]"), ("api_key", ""), ("admin_key", "")):
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise bad_request(f"'{name}' must be a string{form}", name)
    auth = UpstreamAuth.of_keys(fields.get("api_key"), fields.get("admin_key"))
    if fields.get("events") is None:
        return url, None, auth
    try:
        return url, EventEndpoints.parse(fields["events"]), auth
    except ValueError as error:
        raise bad_request(str(error), "events") from None


async def _add_replica(router: Router, request: HttpRequest, responder: Responder) -> None:
    url, events, auth = _admin_fields(request)
    try:
        replica = router.registry.add(url, events=events, auth=auth)
    except ValueError as error:
        raise bad_request(str(error), "url") from None
    responder.send_json(200, replica.describe())


async def _drain_replica(router: Router, request: HttpRequest, responder: Responder) -> None:
    url = _admin_url(request)
    try:
        responder.send_json(200, router.registry.drain(url).describe())
    except KeyError:
        raise APIError(404, f"no replica {url!r}", param="url", code="replica_not_found") from None


async def _remove_replica(router: Router, request: HttpRequest, responder: Responder) -> None:
    url = _admin_url(request)
    try:
        replica = await router.registry.remove(url)
    except KeyError:
        raise APIError(404, f"no replica {url!r}", param="url", code="replica_not_found") from None
    responder.send_json(200, replica.describe())


_ROUTES: dict[str, dict[str, Endpoint]] = {
    "/v1/completions": {"POST": _completions},
    "/v1/chat/completions": {"POST": _chat_completions},
    "/v1/models": {"GET": _models},
    "/health": {"GET": _health},
    "/tokenize": {"POST": _tokenize},
    "/detokenize": {"POST": _detokenize},
    "/v1/embeddings": {"POST": _pooling},
    "/rerank": {"POST": _pooling},
    "/v1/rerank": {"POST": _pooling},
    "/v2/rerank": {"POST": _pooling},
    "/score": {"POST": _pooling},
    "/v1/score": {"POST": _pooling},
    "/version": {"GET": _version},
    "/load": {"GET": _load},
    "/openapi.json": {"GET": _openapi},
    "/metrics": {"GET": _metrics},
    "/admin/replicas": {"GET": _list_replicas, "POST": _add_replica, "DELETE": _remove_replica},
    "/admin/replicas/drain": {"POST": _drain_replica},
}
MODELS_PREFIX = "/v1/models/"
_PREFIX_ROUTES: dict[str, dict[str, Endpoint]] = {MODELS_PREFIX: {"GET": _model}}
_ACCESS: dict[str, Access] = {
    "/health": Access.PUBLIC,
    "/version": Access.PUBLIC,
    "/openapi.json": Access.PUBLIC,
    "/metrics": Access.PUBLIC,  # unless metrics_need_key
    "/admin/replicas": Access.ADMIN,
    "/admin/replicas/drain": Access.ADMIN,
}


# ---------------------------------------------------------------------------- process


async def serve(
    config: RouterConfig,
    replica_urls: Sequence[str],
    host: str,
    port: int,
    prefill_urls: Sequence[str] = (),
    decode_urls: Sequence[str] = (),
    replica_events: Sequence[EventEndpoints | None] = (),
) -> None:
    """Run the router until SIGINT/SIGTERM, then let requests in progress finish. `replica_events[i]` is where the
    vLLM or SGLang replica `replica_urls[i]` publishes its KV events."""
    router = Router.create(config)
    for number, url in enumerate(replica_urls):
        router.registry.add(url, events=replica_events[number] if number < len(replica_events) else None)
    for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
        for url in urls:
            router.registry.add(url, role)
    replica_urls = [*replica_urls, *prefill_urls, *decode_urls]
    gc.freeze()  # the router's indexes live as long as it does: full garbage collections need not walk them
    server = HttpServer(router.handle, config.http)
    await server.start(host, port)
    scheme = "https" if config.http.ssl_certfile else "http"
    replicas = ", ".join(replica_urls) or "none yet (add them with POST /admin/replicas)"
    _say(
        f"listening on {scheme}://{host}:{server.port}, policy {config.policy}, {len(replica_urls)} replica(s): "
        f"{replicas}"
    )
    if prefill_urls or decode_urls:
        _say(
            f"disaggregation {config.disaggregation}: prefill {', '.join(prefill_urls) or 'none'}; decode "
            f"{', '.join(decode_urls) or 'those reporting role decode'}"
        )
    _say(
        f"API keys {'required' if router.keys.enabled else 'not required'}; admin plane "
        f"{'on' if router.admin_key.digest is not None else 'off (no --admin-key)'}"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, router.reload_keys)
    try:
        await stop.wait()
    finally:
        _say("shutting down")
        await server.shutdown(SHUTDOWN_GRACE_S)
        with contextlib.suppress(Exception):
            await router.close()
        _say("stopped")


def _say(message: str) -> None:
    print(f"kvyard route: {message}", file=sys.stderr, flush=True)

"""The HTTP API of one replica (docs/contracts.md §4), over any `ReplicaEngine`: a model or a simulated one.

Served by kvyard's own HTTP/1.1 server (`kvyard.net`), the stack that costs the least CPU per streamed
request (`benchmarks/replica_http_stack.py`). Besides the OpenAI endpoints and kvyard's own (`/load`,
`/kv/*`, `/tokenize`, `/metrics`) it answers the probes other routers send to their engines
(`/server_info`, `/model_info`, `/loads`, `/version`, ...), so those routers can front kvyard replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvyard import __version__
from kvyard.api import kv_events
from kvyard.api.auth import Access, AdminKey, KeySet, bearer_token, tenant_salt
from kvyard.api.checks import check_token_ids
from kvyard.api.errors import APIError, InputError, bad_request, error_body
from kvyard.api.load import LoadReport
from kvyard.api.metrics import REJECTED_OVERLOAD, EngineCounters, ServerMetrics
from kvyard.api.openapi import openapi_document
from kvyard.api.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest, ScoringFields
from kvyard.api.protocol import (
    IGNORED_FIELDS_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    drop_unknown,
    header_safe_names,
    json_object,
    take_token_ids,
    validate,
)
from kvyard.api.ratelimit import RateLimiter
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.pd_stream import RELEASE_PATH, TRANSFER_PATH, TRANSFER_TOKEN_HEADER
from kvyard.net.http_server import Endpoint, HttpRequest, HttpServerError, Responder, RouteTable
from kvyard.server.backend import ReplicaEngine
from kvyard.server.completions import CompletionRunner
from kvyard.server.options import ServerOptions
from kvyard.server.pd_sender import APPEAR_WAIT_S, send_transfer
from kvyard.server.pooling import (
    PoolingJob,
    embedding_job,
    embedding_response,
    rerank_response,
    run_job,
    score_pairs,
    score_response,
    scoring_job,
)
from kvyard.server.prepare import (
    PreparedRequest,
    check_model,
    prepare_chat,
    prepare_completion,
    render_chat,
    vocabulary_of,
)
from kvyard.server.reasoning import ReasoningParser
from kvyard.server.transfer_tokens import TransferTokens

_LOG = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
MODELS_PREFIX = "/v1/models/"
INLINE_TOKENIZE_BYTES = 16 << 10  # smaller bodies tokenize on the event loop (a thread hop costs more)
TOKENIZE_QUEUE = 64  # large requests waiting for the tokenizer thread at most; more wait for a slot
Prepared = TypeVar("Prepared")
PoolingBody = TypeVar("PoolingBody", bound=EmbeddingRequest | ScoringFields)


class ReplicaApp:
    """Routes, admission and the engine's readiness; `handle` is the HTTP server's entry point."""

    def __init__(self, options: ServerOptions, engine: ReplicaEngine | None = None) -> None:
        self.options = options
        self.reasoning = ReasoningParser.named(options.reasoning_parser)
        self.engine: ReplicaEngine | None = None
        self._metrics: ServerMetrics | None = None  # made with the engine: its samples name the model served
        self.load_error: BaseException | None = None
        self.in_flight = 0  # admitted requests not yet answered
        self.in_flight_seqs = 0  # their sequences (prompts × n): what admission counts
        self.draining = False  # stop admitting requests (shutdown)
        self.shutting_down = False  # also end the endless streams (KV events)
        self.started = time.time()
        # One thread: tokenizers are not all safe to share between threads, and the point is to free the loop.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvyard-tokenize")
        self._tokenize_slots = asyncio.Semaphore(TOKENIZE_QUEUE)
        self.keys = KeySet.from_settings(options.access.api_keys, options.access.api_keys_file)
        self.admin_key = AdminKey.from_settings(options.access.admin_key)
        self.limiter = RateLimiter(options.access.requests_per_min, options.access.tokens_per_min)
        self.routes = RouteTable()
        self.access: dict[str, Access] = {}
        self.add_routes(self._own_routes())
        self.add_routes(
            {("GET", "/kv/events"): self.kv_events, ("GET", "/kv/snapshot"): self.kv_snapshot}, Access.ADMIN
        )
        # A transfer's blocks: the admin, or the decode replica holding that transfer's token (_authorize_pull).
        self.transfer_tokens = TransferTokens()
        self.add_routes(
            {("GET", TRANSFER_PATH): self.kv_transfer, ("POST", RELEASE_PATH): self.kv_release}, Access.PUBLIC
        )
        public = {("GET", path): self.health for path in ("/health", "/health_generate")}
        public["GET", "/version"] = self.version
        public["GET", "/openapi.json"] = self.openapi
        if not options.access.metrics_need_key:
            public["GET", "/metrics"] = self.prometheus
        self.add_routes(public, Access.PUBLIC)
        if engine is not None:
            self.set_engine(engine)

    def add_routes(self, routes: Mapping[tuple[str, str], Endpoint], access: Access = Access.API) -> None:
        """Serve `routes` to callers with `access`: anyone, API-key holders (when keys are set), or the admin."""
        for (method, path), endpoint in routes.items():
            self.routes.add(method, path, endpoint)
            self.access[path] = access

    def set_engine(self, engine: ReplicaEngine) -> None:
        """The engine is ready (the model has loaded): start serving it."""
        self.engine = engine
        self.reset_metrics()

    def reset_metrics(self) -> None:
        """Start the counters from zero, as a restarted replica would (the engine's collectors stay)."""
        if self.engine is None:
            return
        self._metrics = ServerMetrics(self.engine.model_name, self._engine_stats)
        for collector in self.engine.collectors():
            self._metrics.registry.register(collector)

    @property
    def metrics(self) -> ServerMetrics:
        """The metrics of the engine served: made with it, so there wherever ready() has passed."""
        if self._metrics is None:
            raise RuntimeError("no engine is served yet: its metrics do not exist")
        return self._metrics

    def reload_keys(self) -> None:
        """Read the API-key file again (SIGHUP); on failure the keys in force stay."""
        try:
            self.keys.reload()
        except OSError as error:
            print(f"kvyard: cannot read the API-key file, keeping the current keys: {error}", file=sys.stderr)

    def begin_shutdown(self) -> None:
        self.draining = self.shutting_down = True
        self._tokenizer_thread.shutdown(wait=False)

    def ready(self) -> ReplicaEngine:
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", code="model_load_failed")
        if self.engine is None:
            raise APIError(503, "model is still loading", code="loading", retry_after=5)
        self.engine.check_ready()
        return self.engine

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        try:
            endpoint = self.routes.find(request)
            self._authorize(request)
            await endpoint(request, responder)
        except HttpServerError as error:
            _send_error(responder, APIError(error.status, str(error), code=_HTTP_CODES.get(error.status)))
        except InputError as error:
            _send_error(responder, APIError.from_input(error))
        except APIError as error:
            _send_error(responder, error)

    def _authorize(self, request: HttpRequest) -> None:
        access = self.access.get(request.path, Access.API)
        if access is Access.API:
            self.keys.authenticate(request.headers)
        elif access is Access.ADMIN:
            self.admin_key.authorize(request.headers, request.path)

    def caller_key(self, request: HttpRequest) -> str | None:
        """The key a request came with: the API key it was admitted with, else (no keys set) its bearer token."""
        return self.keys.authenticate(request.headers) or bearer_token(request.headers)

    def _own_routes(self) -> dict[tuple[str, str], Endpoint]:
        routes: dict[tuple[str, str], Endpoint] = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("GET", "/v1/models"): self.models,
            ("GET", MODELS_PREFIX): self.model,
            ("GET", "/load"): self.load,
            ("GET", "/metrics"): self.prometheus,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/loads"): self.sglang_load,
            ("GET", "/get_load"): self.sglang_load,
            ("POST", "/v1/embeddings"): self.embeddings,
        }
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            routes["POST", path] = self.rerank
        for path in ("/score", "/v1/score"):
            routes["POST", path] = self.score
        for path in ("/server_info", "/get_server_info"):
            routes["GET", path] = self.server_info
        for path in ("/model_info", "/get_model_info"):
            routes["GET", path] = self.model_info
        return routes

    # ------------------------------------------------------------------ completions

    async def completions(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        raw = json_object(request.body)
        token_ids = take_token_ids(raw)
        ignored = self._ignored_fields(raw, CompletionRequest)
        body = validate(raw, CompletionRequest)
        self._authorize_transfer(request, body)
        salt = self._cache_salt(request, body.cache_salt)
        with self._counting_aborts():
            prepared = await self._prepare(engine, request, lambda: prepare_completion(engine, body, token_ids, salt))
            await self._serve(engine, request, prepared, responder, ignored)

    async def chat_completions(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        raw = json_object(request.body)
        ignored = self._ignored_fields(raw, ChatCompletionRequest)
        body = validate(raw, ChatCompletionRequest)
        self._authorize_transfer(request, body)
        salt = self._cache_salt(request, body.cache_salt)
        parser, reasoning = self.options.tool_call_parser, self.reasoning
        with self._counting_aborts():
            prepared = await self._prepare(engine, request, lambda: prepare_chat(engine, body, salt, parser, reasoning))
            await self._serve(engine, request, prepared, responder, ignored)

    @contextlib.contextmanager
    def _counting_aborts(self) -> Iterator[None]:
        """A client that goes away cancels its request wherever it is (tokenizing, queued, generating): each one
        counts as an abort."""
        try:
            yield
        except asyncio.CancelledError:
            self.metrics.requests.labels(outcome="abort").inc()
            raise

    def _ignored_fields(self, body: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
        """Unknown top-level fields taken out of `body` (refused instead under --reject-unknown-fields), logged,
        and named in the headers returned for the response."""
        if self.options.reject_unknown_fields:
            return {}
        ignored = drop_unknown(body, model)
        if not ignored:
            return {}
        names = header_safe_names(ignored)
        _LOG.warning("request fields ignored (kvyard does not know them): %s", names)
        return {IGNORED_FIELDS_HEADER: names}

    async def _prepare(self, engine: ReplicaEngine, request: HttpRequest, work: Callable[[], Prepared]) -> Prepared:
        """Run `work` (tokenization, chat templates): inline when it is cheap, else on the tokenizer thread, so a
        large request never holds up the event loop (health checks, streams of other requests)."""
        vocabulary = engine.vocabulary
        if vocabulary is None or vocabulary.cheap or len(request.body) < INLINE_TOKENIZE_BYTES:
            return work()
        async with self._tokenize_slots:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, work)

    def _authorize_transfer(self, request: HttpRequest, body: SamplingFields) -> None:
        """Disaggregation pins blocks here, or makes this replica call another: only the admin (the router) may
        ask for it."""
        fields = body.kv_transfer_params
        if fields is not None:
            self.admin_key.authorize_extra(request.headers, "kv_transfer_params")
            if fields.do_remote_decode and fields.transfer_token is not None:
                self.transfer_tokens.add(fields.transfer_id, fields.transfer_token)

    async def _authorize_pull(self, request: HttpRequest, transfer_id: str) -> None:
        """A transfer's blocks go to the admin, or to a caller showing the token its prefill leg filed."""
        token = request.headers.get(TRANSFER_TOKEN_HEADER.lower())
        if token is None:
            self.admin_key.authorize(request.headers, request.path)
        elif not await self.transfer_tokens.matches(transfer_id, token, APPEAR_WAIT_S):
            raise APIError(
                401,
                f"{request.path}: the transfer token does not match transfer {transfer_id!r}",
                "id",
                "invalid_transfer_token",
            )

    def _cache_salt(self, request: HttpRequest, request_salt: str | None) -> str | None:
        return tenant_salt(self.caller_key(request), request_salt, self.options.access.cache_salt_per_api_key)

    async def _serve(
        self,
        engine: ReplicaEngine,
        request: HttpRequest,
        prepared: PreparedRequest,
        responder: Responder,
        headers: dict[str, str],
    ) -> None:
        self.limiter.admit(self.caller_key(request) or request.peer, prepared.num_tokens_asked)
        num_seqs = prepared.num_choices
        self._admit(engine, num_seqs)
        runner = CompletionRunner(engine, self.metrics)
        try:
            if not prepared.stream:
                responder.send_json(200, await runner.complete(prepared), headers)
                return
            responder.start(200, {**SSE_HEADERS, **headers})
            await _stream(responder, runner.sse_events(prepared))
        finally:  # a client that went away cancelled this: its engine requests are aborted
            self.in_flight -= 1
            self.in_flight_seqs -= num_seqs

    def _admit(self, engine: ReplicaEngine, num_seqs: int) -> None:
        """Take the request's sequences into the engine's queue, or refuse it: a request is as large as its
        prompts times n, so one request cannot bring more work than the queue admits."""
        if self.draining:
            raise APIError(503, "server is shutting down", code="draining", retry_after=1)
        limit = engine.max_num_seqs + self.options.max_queued_seqs
        if num_seqs > limit:
            raise bad_request(
                f"the request asks for {num_seqs} sequences (prompts × n); this server takes at most {limit} at once",
                "n",
                "too_many_sequences",
            )
        if self.in_flight_seqs + num_seqs > limit:
            self.metrics.requests.labels(outcome=REJECTED_OVERLOAD).inc()
            raise APIError(
                429,
                f"too many sequences in flight ({self.in_flight_seqs} of {limit}); retry later",
                code="overloaded",
                retry_after=1,
            )
        self.in_flight += 1
        self.in_flight_seqs += num_seqs

    # ------------------------------------------------------------------ pooling: embeddings, rerank, score

    async def embeddings(self, request: HttpRequest, responder: Responder) -> None:
        engine, body, ignored = self._pooling_body(request, EmbeddingRequest)
        salt, method = self._cache_salt(request, body.cache_salt), self.options.pooling
        job = await self._prepare(engine, request, lambda: embedding_job(engine, body, method, salt))
        vectors = await self._pool(engine, request, job)
        responder.send_json(200, embedding_response(engine, body, job, vectors), ignored)

    async def rerank(self, request: HttpRequest, responder: Responder) -> None:
        engine, body, ignored = self._pooling_body(request, RerankRequest)
        pairs = [(body.query, document) for document in body.documents]
        job = await self._scoring_job(engine, request, body, pairs, "documents")
        scores = [result[0] for result in await self._pool(engine, request, job)]
        responder.send_json(200, rerank_response(engine, body, job, scores), ignored)

    async def score(self, request: HttpRequest, responder: Responder) -> None:
        engine, body, ignored = self._pooling_body(request, ScoreRequest)
        job = await self._scoring_job(engine, request, body, score_pairs(body), "text_2")
        scores = [result[0] for result in await self._pool(engine, request, job)]
        responder.send_json(200, score_response(engine, job, scores), ignored)

    def _pooling_body(
        self, request: HttpRequest, model: type[PoolingBody]
    ) -> tuple[ReplicaEngine, PoolingBody, dict[str, str]]:
        """The engine, the validated body of a pooling request for the model it serves, and its ignored fields."""
        engine = self.ready()
        raw = json_object(request.body)
        ignored = self._ignored_fields(raw, model)
        body = validate(raw, model)
        check_model(engine, body.model)
        return engine, body, ignored

    async def _scoring_job(
        self, engine: ReplicaEngine, request: HttpRequest, body: ScoringFields, pairs: list[tuple[str, str]], param: str
    ) -> PoolingJob:
        salt, answers = self._cache_salt(request, body.cache_salt), self.options.score_tokens
        return await self._prepare(engine, request, lambda: scoring_job(engine, body, pairs, answers, salt, param))

    async def _pool(self, engine: ReplicaEngine, request: HttpRequest, job: PoolingJob) -> list[list[float]]:
        """Admit a pooling job as a request of that many sequences and run it."""
        self.limiter.admit(self.caller_key(request) or request.peer, job.num_tokens)
        self._admit(engine, len(job.prompts))
        try:
            with self._counting_aborts():
                results = await run_job(engine, job)
        finally:
            self.in_flight -= 1
            self.in_flight_seqs -= len(job.prompts)
        self.metrics.requests.labels(outcome="stop").inc()
        self.metrics.prompt_tokens.inc(job.num_tokens)
        return results

    # ------------------------------------------------------------------ tokens

    async def tokenize(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        raw = json_object(request.body)
        ignored = self._ignored_fields(raw, TokenizeRequest)
        body = validate(raw, TokenizeRequest)
        check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            messages, generation = body.messages, body.add_generation_prompt
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            tokens = await self._prepare(
                engine, request, lambda: render_chat(engine, messages, generation, None, tools)
            )
        elif isinstance(body.prompt, str):
            vocabulary, text = vocabulary_of(engine, "prompt"), body.prompt
            tokens = await self._prepare(engine, request, lambda: vocabulary.encode(text, body.add_special_tokens))
        else:
            tokens = body.prompt or []
            check_token_ids(tokens, engine.limits.vocab_size)
        answer = {"tokens": tokens, "count": len(tokens), "max_model_len": engine.limits.max_model_len}
        responder.send_json(200, answer, ignored)

    async def detokenize(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        raw = json_object(request.body)
        ignored = self._ignored_fields(raw, DetokenizeRequest)
        body = validate(raw, DetokenizeRequest)
        check_model(engine, body.model)
        vocabulary = vocabulary_of(engine, "tokens")
        if body.tokens:
            check_token_ids(body.tokens, engine.limits.vocab_size, "tokens", "tokens")
        responder.send_json(200, {"prompt": vocabulary.decode(body.tokens)}, ignored)

    # ------------------------------------------------------------------ state and info

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        self.ready()
        if self.draining:
            raise APIError(503, "server is shutting down", code="draining", retry_after=1)
        responder.send_json(200, {"status": "ok"})

    async def models(self, request: HttpRequest, responder: Responder) -> None:
        responder.send_json(200, {"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest, responder: Responder) -> None:
        """GET /v1/models/{id}: the model's card, or a 404 for a model this replica does not serve."""
        check_model(self.ready(), unquote(request.path.removeprefix(MODELS_PREFIX)))
        responder.send_json(200, self._model_card())

    def _model_card(self) -> dict[str, object]:
        engine = self.ready()
        return {
            "id": engine.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": self.options.owned_by,
            "max_model_len": engine.limits.max_model_len,
        }

    def load_report(self) -> LoadReport:
        stats = self.ready().stats()
        return LoadReport(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            in_flight_requests=self.in_flight,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            tokens_in_flight=stats.tokens_in_flight,
            role=self.options.role,
            prefill_s_per_token=stats.prefill_s_per_token or 0.0,
            local_tier_s_per_block=stats.tier_s_per_block.get("local", 0.0),
            shared_tier_s_per_block=stats.tier_s_per_block.get("shared", 0.0),
            shared_tier_available=stats.shared_tier_available,
            tier_load_deadline_s=stats.tier_load_deadline_s,
            tier_load_extension_s_per_block=stats.tier_load_extension_s_per_block,
        )

    async def load(self, request: HttpRequest, responder: Responder) -> None:
        responder.send_json(200, self.load_report().to_json())

    async def sglang_load(self, request: HttpRequest, responder: Responder) -> None:
        """The load as SGLang's routers read it."""
        load = self.load_report()
        responder.send_json(
            200,
            {
                "dp_rank": 0,
                "num_reqs": load.num_waiting + load.num_running,
                "num_waiting_reqs": load.num_waiting,
                "num_running_reqs": load.num_running,
                "num_tokens": load.tokens_in_flight,
                "load": load.in_flight_requests,
            },
        )

    def _engine_stats(self) -> EngineCounters | None:
        return self.engine.stats() if self.engine is not None else None

    async def prometheus(self, request: HttpRequest, responder: Responder) -> None:
        """Nothing while the model loads: until then there is no model to name, nor anything to count."""
        body = generate_latest(self._metrics.registry) if self._metrics is not None else b""
        responder.send(200, body, content_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: HttpRequest, responder: Responder) -> None:
        lenient = not self.options.reject_unknown_fields
        responder.send_json(200, openapi_document(__version__, unknown_fields_ignored=lenient))

    async def version(self, request: HttpRequest, responder: Responder) -> None:
        responder.send_json(200, {"version": __version__, "server": self.options.owned_by})

    async def model_info(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        responder.send_json(
            200,
            {
                "model_path": engine.model_name,
                "served_model_name": engine.model_name,
                "tokenizer_path": None,
                "is_generation": True,
                "max_model_len": engine.limits.max_model_len,
            },
        )

    async def server_info(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        limits = engine.limits
        responder.send_json(
            200,
            {
                "model_path": engine.model_name,
                "served_model_name": engine.model_name,
                "version": __version__,
                "page_size": limits.block_size,
                "context_length": limits.max_model_len,
                "max_total_num_tokens": limits.kv_capacity_tokens,
                "max_running_requests": engine.max_num_seqs,
                "role": self.options.role,
                **engine.server_info(),
            },
        )

    # ------------------------------------------------------------------ KV events (docs/contracts.md §3)

    async def kv_events(self, request: HttpRequest, responder: Responder) -> None:
        log = self._event_log()
        query = parse_qs(request.query)
        since = _int_query(query, "since", 0)
        if query.get("stream", ["true"])[-1].lower() in ("false", "0", "no"):
            responder.send_json(200, kv_events.events_page(log, since))
            return
        responder.start(200, SSE_HEADERS)
        responder.flush_head()  # the stream may stay quiet for long: let the reader know it is subscribed
        seq = since
        while not self.shutting_down and self.engine is not None and self.engine.kv_event_log() is log:
            events, complete = log.events_since(seq)
            if not complete:
                responder.write(kv_events.sse_gap(log, seq, events))
                break
            if events:
                responder.write(kv_events.sse_events(events))
                seq = events[-1].seq
            else:
                await asyncio.sleep(kv_events.POLL_INTERVAL_S)
        responder.end()

    async def kv_snapshot(self, request: HttpRequest, responder: Responder) -> None:
        self._event_log()
        snapshot = await self.ready().kv_snapshot()
        responder.send_json(
            200,
            kv_events.snapshot_json(
                snapshot.seq,
                snapshot.block_keys,
                snapshot.namespace,
                snapshot.local_keys,
                snapshot.shared_store,
                self.options.access.cache_salt_per_api_key,
                snapshot.segments,
                snapshot.blend,
            ),
        )

    # ------------------------------------------------------------------ KV transfer (docs/contracts.md §6)

    async def kv_transfer(self, request: HttpRequest, responder: Responder) -> None:
        engine = self.ready()
        query = parse_qs(request.query)
        transfer_id = query.get("id", [""])[-1]
        if not transfer_id:
            raise bad_request("give the transfer's id: ?id=...", "id")
        start = _int_query(query, "from", 0)
        if start < 0:
            raise bad_request(f"from must be >= 0, got {start}", "from")
        await self._authorize_pull(request, transfer_id)
        await send_transfer(engine, transfer_id, start, responder, lambda: self.shutting_down)

    async def kv_release(self, request: HttpRequest, responder: Responder) -> None:
        transfer_id = parse_qs(request.query).get("id", [""])[-1]
        if not transfer_id:
            raise bad_request("give the transfer's id: ?id=...", "id")
        await self._authorize_pull(request, transfer_id)
        self.transfer_tokens.forget(transfer_id)
        if not await self.ready().release_export(transfer_id):
            raise APIError(404, f"no transfer {transfer_id!r} (released or expired)", "id", "transfer_not_found")
        responder.send_json(200, {"released": transfer_id})

    def _event_log(self) -> KVEventLog:
        log = self.ready().kv_event_log()
        if log is None:
            raise APIError(404, "this replica does not record KV events", code="kv_events_disabled")
        return log


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


async def _stream(responder: Responder, events: AsyncIterator[bytes]) -> None:
    """Send server-sent events; a failure after the first byte ends the stream with an error event, so a client
    never mistakes a broken answer for a finished one."""
    try:
        async for chunk in events:
            responder.write(chunk)
    except Exception as error:  # a bug, not bad input (that is an error event already): say so, then end
        _LOG.exception("stream failed")
        responder.write(
            b"data: " + orjson.dumps(error_body(500, f"internal error: {error}", code="internal_error")) + b"\n\n"
        )
    responder.end()


def _send_error(responder: Responder, error: APIError) -> None:
    if responder.started:
        responder.abort()  # the status line is out: closing is the only way left to say it failed
    else:
        responder.send_json(error.status, error.body(), error.headers())


def _int_query(query: dict[str, list[str]], name: str, default: int) -> int:
    values = query.get(name)
    if not values:
        return default
    try:
        return int(values[-1])
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {values[-1]!r}", name) from None

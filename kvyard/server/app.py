"""The HTTP API of one replica (DESIGN.md, contract 4)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from kvyard.api.errors import APIError, bad_request
from kvyard.engine.llm_engine import EngineConfig, LLMEngine
from kvyard.server.async_engine import AsyncEngine, EngineDeadError
from kvyard.server.completions import CompletionRunner, PreparedRequest, build_sampling_params, new_request_id
from kvyard.server.kv_events import kv_event_routes
from kvyard.server.kv_tier_metrics import KVTierCollector
from kvyard.server.metrics import ServerMetrics
from kvyard.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    max_queued_requests: int = 512  # requests admitted beyond max_num_seqs before answering 429
    cache_salt_per_api_key: bool = False


@dataclass(slots=True)
class Replica:
    """Everything the routes share; `engine` is None until the model has loaded."""

    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: AsyncEngine | None = None
    runner: CompletionRunner | None = None
    load_error: BaseException | None = None
    in_flight: int = 0
    draining: bool = False
    shutting_down: bool = False  # a shutdown signal arrived; endless streams (KV events) end
    started: float = field(default_factory=time.time)

    @property
    def llm(self) -> LLMEngine:
        return self.ready_engine().engine

    def ready_engine(self) -> AsyncEngine:
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", code="model_load_failed")
        if self.engine is None or self.runner is None:
            raise APIError(503, "model is still loading", code="loading", retry_after=5)
        if self.engine.error is not None:
            raise APIError(503, f"engine stopped: {self.engine.error}", code="engine_dead")
        return self.engine


def create_app(config: ServerConfig, engine: LLMEngine | None = None) -> FastAPI:
    """Build the app. The model loads in the background unless an `engine` is passed in."""
    replica = Replica(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(_load(replica, engine))
        yield
        replica.draining = True
        loader.cancel()
        if replica.engine is not None:
            await asyncio.to_thread(replica.engine.stop)

    app = FastAPI(title="kvyard replica", lifespan=lifespan)
    app.state.replica = replica
    _install_error_handlers(app)
    _add_info_routes(app, replica)
    _add_completion_routes(app, replica)
    _add_token_routes(app, replica)
    kv_event_routes(app, replica.ready_engine, lambda: replica.shutting_down)
    return app


class ReplicaServer(uvicorn.Server):
    """uvicorn's server that also tells open KV-event streams to end on a shutdown signal: those
    never finish by themselves, and the graceful shutdown waits for every open response."""

    def __init__(self, config: uvicorn.Config, replica: Replica) -> None:
        super().__init__(config)
        self.replica = replica

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.replica.shutting_down = True
        super().handle_exit(sig, frame)


def serve(config: ServerConfig, host: str, port: int, log_level: str) -> None:
    """Run one replica until SIGINT/SIGTERM, then drain in-flight requests and exit."""
    app = create_app(config)
    ReplicaServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), app.state.replica).run()


async def _load(replica: Replica, engine: LLMEngine | None) -> None:
    try:
        if engine is None:
            engine = await asyncio.to_thread(LLMEngine, replica.config.engine)
        replica.metrics.registry.register(KVTierCollector(engine.kv_tier_snapshot))
        async_engine = AsyncEngine(engine, asyncio.get_running_loop())
        async_engine.start()
        replica.runner = CompletionRunner(async_engine, replica.metrics, engine.tokenizer)
        replica.engine = async_engine
    except Exception as error:
        replica.load_error = error


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.param, error.code, error.retry_after)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_response(error.errors())

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(503, str(error), code="engine_dead")


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, retry_after: int | None = None
) -> JSONResponse:
    error = APIError(status, message, param, code, retry_after)
    return JSONResponse(error.body(), status_code=status, headers=error.headers())


def _validation_response(errors: Any) -> JSONResponse:
    first = errors[0] if errors else {}
    param = _param_name(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return error_response(400, message, param, code=first.get("type"))


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_name(location: Any) -> str | None:
    """`messages.0.role` from pydantic's location, without the union-member tags it adds (`prompt.str`)."""
    parts = []
    for part in location:
        text = str(part)
        if part == "body" or text in _UNION_TAGS or "[" in text or text.startswith("function-"):
            continue
        parts.append(text)
    return ".".join(parts) or None


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _ValidationFailed(error.errors()) from error


class _ValidationFailed(APIError):
    def __init__(self, errors: Any) -> None:
        response = _validation_response(errors)
        payload = json.loads(bytes(response.body))["error"]
        super().__init__(400, payload["message"], payload["param"], payload["code"])


# ---------------------------------------------------------------------------- info routes


def _add_info_routes(app: FastAPI, replica: Replica) -> None:
    @app.get("/health")
    async def health() -> Response:
        replica.ready_engine()
        if replica.draining:
            raise APIError(503, "server is shutting down", code="draining")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        llm = replica.llm
        return {"object": "list", "data": [_model_card(llm, replica.started)]}

    @app.get("/load")
    async def load() -> dict[str, Any]:
        stats = replica.ready_engine().stats
        assert stats is not None  # published before the engine thread starts
        return {
            "num_waiting": stats.num_waiting,
            "num_running": stats.num_running,
            "in_flight_requests": replica.in_flight,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_usage": stats.kv_blocks_used / max(1, stats.kv_blocks_total),
            "tokens_in_flight": stats.tokens_in_flight,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        _refresh_gauges(replica)
        return Response(generate_latest(replica.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model_card(llm: LLMEngine, created: float) -> dict[str, Any]:
    return {
        "id": llm.model_name,
        "object": "model",
        "created": int(created),
        "owned_by": "kvyard",
        "max_model_len": llm.max_model_len,
    }


def _refresh_gauges(replica: Replica) -> None:
    if replica.engine is None:
        return
    stats, m = replica.engine.stats, replica.metrics
    if stats is None:
        return
    m.waiting.set(stats.num_waiting)
    m.running.set(stats.num_running)
    m.kv_blocks_used.set(stats.kv_blocks_used)
    m.kv_blocks_total.set(stats.kv_blocks_total)
    m.prefix_queried.set(stats.prefix_cache_queried_tokens)
    m.prefix_hits.set(stats.prefix_cache_hit_tokens)
    m.preemptions.set(stats.num_preemptions)


# ---------------------------------------------------------------------------- completions


def _add_completion_routes(app: FastAPI, replica: Replica) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await _serve(replica, request, _prepare_completion(replica, request, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await _serve(replica, request, _prepare_chat(replica, request, body))


async def _serve(replica: Replica, request: Request, prepared: PreparedRequest) -> Response:
    runner = replica.runner
    assert runner is not None  # _prepare_* checked readiness
    _admit(replica)
    if prepared.stream:
        holdback = max((len(s) for s in prepared.params[0].stop), default=1) - 1
        return _CountedStream(replica, runner.sse_events(prepared, holdback))
    try:
        result = await _cancel_on_disconnect(request, runner.complete(prepared))
    finally:
        replica.in_flight -= 1
    return JSONResponse(result)


def _admit(replica: Replica) -> None:
    if replica.draining:
        raise APIError(503, "server is shutting down", code="draining", retry_after=1)
    limit = replica.llm.config.scheduler.max_num_seqs + replica.config.max_queued_requests
    if replica.in_flight >= limit:
        replica.metrics.requests.labels(outcome="rejected_overload").inc()
        raise APIError(429, f"too many requests in flight ({replica.in_flight}); retry later",
                       code="overloaded", retry_after=1)  # fmt: skip
    replica.in_flight += 1


class _CountedStream(StreamingResponse):
    """An SSE response that leaves the in-flight count however it ends, even if never iterated."""

    def __init__(self, replica: Replica, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.replica = replica

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.replica.in_flight -= 1


async def _cancel_on_disconnect(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            break
    return await task


def _prepare_completion(replica: Replica, request: Request, body: CompletionRequest) -> PreparedRequest:
    llm = _checked_model(replica, body.model)
    _reject_unsupported(body.unsupported())
    prompts = [_tokens_of(llm, prompt, index) for index, prompt in enumerate(_prompt_list(body.prompt))]
    return _prepared("completion", replica, request, body, prompts, body.max_tokens, body.logprobs)


def _prepare_chat(replica: Replica, request: Request, body: ChatCompletionRequest) -> PreparedRequest:
    llm = _checked_model(replica, body.model)
    _reject_unsupported(body.unsupported())
    prompt = render_chat(llm, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _prepared("chat", replica, request, body, [prompt], body.requested_max_tokens, logprobs)


def _prepared(
    kind: str,
    replica: Replica,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
) -> PreparedRequest:
    llm = replica.llm
    longest = max(len(p) for p in prompts)
    if max_tokens is None:
        max_tokens = llm.max_model_len - longest
    if longest + max_tokens > llm.max_model_len:
        raise APIError(400, f"this model's maximum context length is {llm.max_model_len} tokens; the request "
                       f"has {longest} prompt tokens and max_tokens {max_tokens}", "max_tokens",
                       "context_length_exceeded")  # fmt: skip
    return PreparedRequest(
        kind=kind,
        request_id=new_request_id(kind),
        model=llm.model_name,
        prompts=prompts,
        params=build_sampling_params(body, max_tokens, logprobs),
        cache_salt=_cache_salt(replica, request, body.cache_salt),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage) or not body.stream,
        logprobs=logprobs,
    )


def _checked_model(replica: Replica, model: str | None) -> LLMEngine:
    llm = replica.llm
    if model is not None and model != llm.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{llm.model_name}'",
                       "model", "model_not_found")  # fmt: skip
    return llm


def _reject_unsupported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        raise bad_request(problem[1], problem[0], "unsupported_parameter")


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _tokens_of(llm: LLMEngine, prompt: str | list[int], index: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"prompt {index} is empty", "prompt")
        if llm.tokenizer is None:
            raise bad_request("text prompts need a tokenizer; send token ids", "prompt")
        tokens: list[int] = llm.tokenizer.encode(prompt)  # adds BOS where the tokenizer wants one
    else:
        tokens = prompt
    if not tokens:
        raise bad_request(f"prompt {index} is empty", "prompt")
    vocab = llm.model_config.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt {index} has token id {bad} outside the vocabulary [0, {vocab})", "prompt")
    return tokens


def render_chat(
    llm: LLMEngine, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict[str, Any] | None
) -> list[int]:
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text: str = llm.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
        )
    except Exception as error:
        raise bad_request(f"chat template failed on these messages: {error}", "messages") from error
    tokens: list[int] = llm.tokenizer.encode(text, add_special_tokens=False)
    if not tokens:
        raise bad_request("messages render to an empty prompt", "messages")
    return tokens


def _cache_salt(replica: Replica, request: Request, salt: str | None) -> str | None:
    if salt is not None or not replica.config.cache_salt_per_api_key:
        return salt
    authorization = request.headers.get("authorization", "")
    if not authorization.lower().startswith("bearer "):
        return None
    return "key:" + hashlib.sha256(authorization[7:].strip().encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------- tokenization


def _add_token_routes(app: FastAPI, replica: Replica) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest)
        llm = _checked_model(replica, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            tokens = render_chat(llm, body.messages, body.add_generation_prompt, None)
        else:
            if llm.tokenizer is None:
                raise bad_request("this model directory has no tokenizer", "prompt")
            tokens = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        llm = _checked_model(replica, body.model)
        if llm.tokenizer is None:
            raise bad_request("this model directory has no tokenizer", "tokens")
        vocab = llm.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

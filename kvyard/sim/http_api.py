"""The HTTP API of one simulated replica (aiohttp): the same endpoints and formats as `kvyard serve`.

Differences from a real replica: one prompt and one choice per request; sampling fields are
accepted and ignored (the output is a deterministic function of the prompt and `seed`, always
exactly `max_tokens` long, finish reason `length`); text is tokenized one token per UTF-8 byte
(`kvyard/sim/tokens.py`). It also answers the probes of other routers (`/get_model_info`,
`/get_server_info`, `/server_info`, `/model_info`, `/version`, `/loads`, `/get_load`,
`/health_generate`) with small, plausible JSON.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Literal, cast

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from kvyard import __version__
from kvyard.api.errors import APIError, bad_request
from kvyard.kvcache.events import event_json
from kvyard.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest
from kvyard.sim.completion_reply import Reply
from kvyard.sim.http_io import error_json, int_query, json_response, parse_body, read_json, take_token_ids, validate
from kvyard.sim.replica import SimReplica
from kvyard.sim.tokens import decode, encode, render_chat

KV_EVENTS_POLL_S = 0.02
_LOG = logging.getLogger("kvyard.sim")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimCompletionRequest(CompletionRequest):
    """Routers in front of a replica add their own engine's fields (sglang's `no_stop_trim`, ...);
    the sim, which samples nothing, ignores unknown fields instead of refusing the request."""

    model_config = ConfigDict(extra="ignore")


class SimChatCompletionRequest(ChatCompletionRequest):
    model_config = ConfigDict(extra="ignore")


class SimTokenizeRequest(BaseModel):
    """`/tokenize` body: text, token ids (returned as they are), or chat messages. Unknown fields are
    ignored: other routers call this endpoint with their own engine's options."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


def create_app(replica: SimReplica) -> web.Application:
    app = web.Application(middlewares=[_error_middleware], client_max_size=64 << 20)
    api = _Api(replica)
    routes = [
        web.post("/v1/completions", api.completions),
        web.post("/v1/chat/completions", api.chat_completions),
        web.post("/tokenize", api.tokenize),
        web.post("/detokenize", api.detokenize),
        web.get("/v1/models", api.models),
        web.get("/health", api.health),
        web.get("/health_generate", api.health),
        web.get("/load", api.load),
        web.get("/loads", api.sglang_load),
        web.get("/get_load", api.sglang_load),
        web.get("/metrics", api.metrics),
        web.get("/kv/events", api.kv_events),
        web.get("/kv/snapshot", api.kv_snapshot),
        web.get("/version", api.version),
        web.post("/sim/restart", api.restart),
        web.post("/sim/health", api.set_health),
    ]
    routes += [web.get(path, api.model_info) for path in ("/get_model_info", "/model_info")]
    routes += [web.get(path, api.server_info) for path in ("/get_server_info", "/server_info")]
    app.add_routes(routes)
    return app


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as error:
        return error_json(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return error_json(APIError(error.status, f"{request.method} {request.path}: {error.reason}"))
    except Exception as error:
        _LOG.exception("request %s %s failed", request.method, request.path)
        return error_json(APIError(500, f"internal error: {error}", code="internal_error"))


class _Api:
    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica
        self.config = replica.config

    # ------------------------------------------------------------------ completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await read_json(request)
        token_ids = take_token_ids(raw)
        body: CompletionRequest = validate(raw, SimCompletionRequest)
        self._check_common(body.model, body.n, body.unsupported())
        prompt = self._prompt_tokens(body.prompt if token_ids is None else token_ids)
        return await self._serve(request, "completion", body, prompt, body.max_tokens)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body: ChatCompletionRequest = await parse_body(request, SimChatCompletionRequest)
        self._check_common(body.model, body.n, body.unsupported())
        prompt = encode(render_chat([(m.role, m.text()) for m in body.messages], body.add_generation_prompt))
        return await self._serve(request, "chat", body, prompt, body.requested_max_tokens)

    def _check_common(self, model: str | None, n: int, unsupported: tuple[str, str] | None) -> None:
        self._check_model(model)
        if unsupported is not None:
            raise bad_request(unsupported[1], unsupported[0], "unsupported_parameter")
        if n != 1:
            raise bad_request("n must be 1: a simulated replica returns one choice", "n", "unsupported_parameter")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.config.model_name}'",
                           "model", "model_not_found")  # fmt: skip

    def _prompt_tokens(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request("a simulated replica serves one prompt per request", "prompt")
            prompt = prompt[0]
        tokens = encode(prompt) if isinstance(prompt, str) else cast("list[int]", prompt)
        if not tokens:
            raise bad_request("prompt must not be empty", "prompt")
        vocab = self.config.vocab_size
        if min(tokens) < 0 or max(tokens) >= vocab:
            bad = next(t for t in tokens if not 0 <= t < vocab)
            raise bad_request(f"prompt has token id {bad} outside the vocabulary [0, {vocab})", "prompt")
        return tokens

    async def _serve(
        self,
        request: web.Request,
        kind: Literal["completion", "chat"],
        body: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        max_tokens: int | None,
    ) -> web.StreamResponse:
        self._check_healthy()
        max_tokens = self._check_length(prompt, max_tokens)
        replica = self.replica
        limit = self.config.max_num_seqs + self.config.max_queued_requests
        if replica.in_flight >= limit:
            replica.metrics.requests.labels(outcome="rejected_overload").inc()
            raise APIError(429, f"too many requests in flight ({replica.in_flight}); retry later",
                           code="overloaded", retry_after=1)  # fmt: skip
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        replica.in_flight += 1
        stream = replica.submit(request_id, prompt, max_tokens, body.cache_salt, body.seed, body.stream)
        try:
            reply = Reply(kind, request_id, self.config.model_name, stream)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await reply.sse(request, include_usage)
            return await reply.whole()
        finally:
            replica.in_flight -= 1
            replica.abort(stream)  # no-op once finished; a client that went away frees its blocks

    def _check_length(self, prompt: list[int], max_tokens: int | None) -> int:
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            message = f"prompt has {len(prompt)} tokens; the context is {limit} tokens and one must be left to generate"
            raise bad_request(message, "prompt", "context_length_exceeded")
        if max_tokens is None:  # as much as the context and the cache can hold
            max_tokens = min(limit, self.config.capacity_blocks * self.config.block_size) - len(prompt)
            if max_tokens < 1:
                raise bad_request(f"prompt has {len(prompt)} tokens: no room left in the KV cache", "prompt")
        if len(prompt) + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the request has "
                           f"{len(prompt)} prompt tokens and max_tokens {max_tokens}", "max_tokens",
                           "context_length_exceeded")  # fmt: skip
        needed = self.replica.scheduler.blocks_needed(len(prompt) + max_tokens)
        if needed > self.config.capacity_blocks:
            raise APIError(400, f"max_tokens: prompt plus max_tokens needs {needed} KV blocks but the cache has "
                           f"{self.config.capacity_blocks}", "max_tokens", "kv_capacity_exceeded")  # fmt: skip
        return max_tokens

    # ------------------------------------------------------------------ tokens

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body: SimTokenizeRequest = await parse_body(request, SimTokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            tokens = encode(render_chat([(m.role, m.text()) for m in body.messages], body.add_generation_prompt))
        elif isinstance(body.prompt, str):
            tokens = encode(body.prompt)
        else:
            tokens = self._prompt_tokens(body.prompt or [])
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.config.max_model_len})

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        self._check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})", "tokens")
        return json_response({"prompt": decode(body.tokens)})

    # ------------------------------------------------------------------ info

    async def models(self, _: web.Request) -> web.StreamResponse:
        card = {"id": self.config.model_name, "object": "model", "created": int(self.replica.started),
                "owned_by": "kvyard-sim", "max_model_len": self.config.max_model_len}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def health(self, _: web.Request) -> web.StreamResponse:
        self._check_healthy()
        return json_response({"status": "ok"})

    def _check_healthy(self) -> None:
        if not self.replica.healthy:
            raise APIError(503, "this simulated replica is set unhealthy", code="unhealthy", retry_after=1)

    # ------------------------------------------------------------------ fault injection (for router tests)

    async def restart(self, _: web.Request) -> web.StreamResponse:
        self.replica.restart()
        return json_response({"status": "restarted"})

    async def set_health(self, request: web.Request) -> web.StreamResponse:
        healthy = (await read_json(request)).get("healthy")
        if not isinstance(healthy, bool):
            raise bad_request("healthy must be true or false", "healthy")
        self.replica.healthy = healthy
        return json_response({"healthy": healthy})

    async def load(self, _: web.Request) -> web.StreamResponse:
        return json_response(self.replica.load())

    async def sglang_load(self, _: web.Request) -> web.StreamResponse:
        load = self.replica.load()
        return json_response({"dp_rank": 0, "num_reqs": load["num_waiting"] + load["num_running"],
                              "num_waiting_reqs": load["num_waiting"], "num_running_reqs": load["num_running"],
                              "num_tokens": load["tokens_in_flight"], "load": self.replica.in_flight})  # fmt: skip

    async def metrics(self, _: web.Request) -> web.StreamResponse:
        self.replica.refresh_gauges()
        return web.Response(body=generate_latest(self.replica.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})  # fmt: skip

    async def version(self, _: web.Request) -> web.StreamResponse:
        return json_response({"version": __version__, "server": "kvyard-sim"})

    async def model_info(self, _: web.Request) -> web.StreamResponse:
        name = self.config.model_name
        return json_response({"model_path": name, "served_model_name": name, "tokenizer_path": None,
                              "is_generation": True, "max_model_len": self.config.max_model_len})  # fmt: skip

    async def server_info(self, _: web.Request) -> web.StreamResponse:
        config = self.config
        return json_response({
            "model_path": config.model_name,
            "served_model_name": config.model_name,
            "version": __version__,
            "page_size": config.block_size,
            "context_length": config.max_model_len,
            "max_total_num_tokens": config.capacity_blocks * config.block_size,
            "max_running_requests": config.max_num_seqs,
            "chunked_prefill_size": config.max_num_batched_tokens,
            "simulated": True,
            "replica_index": self.replica.index,
            "time_scale": config.time_scale,
            "cost_model": config.cost.to_json(),
        })  # fmt: skip

    # ------------------------------------------------------------------ KV events

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        since = int_query(request, "since", 0)
        stream = request.query.get("stream", "true").lower() not in ("false", "0", "no")
        log = self.replica.events
        if not stream:
            events, complete = log.events_since(since)
            return json_response({"events": [event_json(e) for e in events], "complete": complete,
                                  "last_seq": log.last_seq})  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        seq = since
        try:
            while self.replica.events is log:  # a restart ends the stream, as a real restart drops it
                events, complete = log.events_since(seq)
                if not complete:
                    payload = {"since": seq, "first_available": events[0].seq if events else log.last_seq + 1}
                    await response.write(b"event: gap\ndata: " + orjson.dumps(payload) + b"\n\n")
                    break
                if events:
                    await response.write(b"".join(b"data: " + orjson.dumps(event_json(e)) + b"\n\n" for e in events))
                    seq = events[-1].seq
                else:
                    await asyncio.sleep(KV_EVENTS_POLL_S)
        except ConnectionError:
            return response
        await response.write_eof()
        return response

    async def kv_snapshot(self, _: web.Request) -> web.StreamResponse:
        namespace = asdict(self.replica.namespace)
        namespace.pop("cache_salt")
        keys = [key.hex() for key in self.replica.cache.cached_keys()]
        return json_response({"seq": self.replica.events.last_seq, "block_keys": keys, "namespace": namespace})

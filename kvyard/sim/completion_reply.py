"""The OpenAI response of one simulated request, built from its token stream: whole, or as server-sent events."""

from __future__ import annotations

import time
from typing import Any, Literal

from aiohttp import web

from kvyard.api.errors import APIError, error_body
from kvyard.sim.http_io import json_response, sse_bytes
from kvyard.sim.replica import RequestStream
from kvyard.sim.tokens import decode

RESTARTED = "the replica restarted while serving this request"


class Reply:
    """Builds the OpenAI response of one request from its token stream, whole or as server-sent events."""

    def __init__(self, kind: Literal["completion", "chat"], request_id: str, model: str, stream: RequestStream) -> None:
        self.kind = kind
        self.stream = stream
        self.envelope = {"id": request_id, "object": "", "created": int(time.time()), "model": model}

    async def whole(self) -> web.Response:
        tokens: list[int] = []
        finished = False
        while not finished:
            new, finished = await self.stream.next_tokens()
            tokens.extend(new)
        if self.stream.request.finish_reason == "abort":
            raise APIError(503, RESTARTED, code="replica_restarted")
        text = decode(tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "stop_reason": None, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        return json_response({**self.envelope, "object": kind, "choices": [choice], "usage": self.usage()})

    async def sse(self, request: web.Request, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            if self.kind == "chat":
                await response.write(self._chunk({"role": "assistant", "content": ""}, None))
            finished = False
            while not finished:
                tokens, finished = await self.stream.next_tokens()
                if self.stream.request.finish_reason == "abort":  # restarted: end without [DONE]
                    await response.write(sse_bytes(error_body(503, RESTARTED, None, "replica_restarted")))
                    return response
                text = decode(tokens)
                await response.write(self._chunk({"content": text} if self.kind == "chat" else text,
                                                 "length" if finished else None))  # fmt: skip
            if include_usage:
                await response.write(sse_bytes({**self._envelope(), "choices": [], "usage": self.usage()}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away; the caller aborts the request
        return response

    def usage(self) -> dict[str, Any]:
        request = self.stream.request
        prompt, completion = request.num_prompt_tokens, request.num_output_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max(0, request.num_cached_tokens)},
        }

    def _envelope(self) -> dict[str, Any]:
        return {**self.envelope, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion"}

    def _chunk(self, delta: Any, finish_reason: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        choice["delta" if self.kind == "chat" else "text"] = delta
        return sse_bytes({**self._envelope(), "choices": [choice]})

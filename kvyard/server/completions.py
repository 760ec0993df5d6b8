"""`/v1/completions` and `/v1/chat/completions`: run a prepared request's choices, answer whole or streamed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvyard.api.errors import APIError, InputError
from kvyard.api.metrics import ServerMetrics
from kvyard.engine.core import RequestOutput
from kvyard.engine.sampling.logprobs import TokenLogprobs
from kvyard.server.backend import ReplicaEngine
from kvyard.server.prepare import PreparedRequest
from kvyard.server.reasoning import ReasoningStream
from kvyard.server.tool_calls import ToolStream


@dataclass(slots=True)
class ChoiceState:
    """What has been produced (and, when streaming, sent) for one choice."""

    index: int
    prompt_index: int
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0  # token ids already reported in progress lines
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    sent_logprobs: int = 0  # entries of `logprobs` already streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_local_tier_tokens: int = 0
    num_shared_tier_tokens: int = 0
    num_blended_tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    tool_stream: ToolStream | None = None  # a streamed chat with tools: the calls already sent
    reasoning_stream: ReasoningStream | None = None  # a streamed chat whose reasoning is parsed: what went out
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # echo with logprobs, prompt_logprobs
    echoed: bool = False  # a streamed echo: the prompt went out
    text_offset: int = 0  # characters of the tokens whose logprobs went out (legacy `text_offset`)


Merged = asyncio.Queue[tuple[ChoiceState, RequestOutput] | BaseException | None]


@dataclass(slots=True)
class CompletionRunner:
    engine: ReplicaEngine
    metrics: ServerMetrics

    async def stream_outputs(self, prepared: PreparedRequest) -> AsyncIterator[tuple[ChoiceState, RequestOutput]]:
        """Run every choice concurrently; yield (choice, output) as outputs arrive."""
        choices = [
            ChoiceState(index=p * len(prepared.params) + i, prompt_index=p)
            for p in range(len(prepared.prompts))
            for i in range(len(prepared.params))
        ]
        if prepared.resume is not None:
            choices[0].sent_chars = prepared.resume.sent_chars
            choices[0].sent_tokens = len(prepared.resume.token_ids)
        if len(choices) == 1:  # the common case, without a task and a queue
            async for output in self._generate(prepared, choices[0]):
                yield choices[0], output
            return
        merged: Merged = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(prepared, choice, merged)) for choice in choices]
        try:
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, prepared: PreparedRequest, choice: ChoiceState) -> AsyncIterator[RequestOutput]:
        prompt = prepared.prompts[choice.prompt_index]
        params = prepared.params[choice.index % len(prepared.params)]
        request_id = f"{prepared.request_id}-{choice.index}"
        resumed = prepared.resume.token_ids if prepared.resume is not None else ()
        outputs = self.engine.generate(
            request_id,
            prompt,
            params,
            prepared.cache_salt,
            final_only=not prepared.stream,
            resumed_output_ids=resumed,
            kv_transfer=prepared.kv_transfer,
        )
        async for output in outputs:
            self._record(choice, output)
            yield output

    async def _pump(self, prepared: PreparedRequest, choice: ChoiceState, merged: Merged) -> None:
        try:
            async for output in self._generate(prepared, choice):
                merged.put_nowait((choice, output))
        except Exception as error:
            merged.put_nowait(error)
        finally:
            merged.put_nowait(None)

    def _record(self, choice: ChoiceState, output: RequestOutput) -> None:
        now = time.monotonic()
        num_new = len(output.new_token_ids)
        if choice.last_token_time is None:
            self.metrics.ttft.observe(now - choice.started)
            num_new -= 1
        if num_new > 0 and choice.last_token_time is not None:
            gap = (now - choice.last_token_time) / num_new
            for _ in range(num_new):
                self.metrics.inter_token.observe(gap)
        choice.last_token_time = now
        choice.text = output.text
        choice.token_ids = output.token_ids
        choice.num_cached_tokens = output.num_cached_tokens
        choice.num_local_tier_tokens = output.num_local_tier_tokens
        choice.num_shared_tier_tokens = output.num_shared_tier_tokens
        choice.num_blended_tokens = output.num_blended_tokens
        if output.logprobs is not None:
            choice.logprobs = output.logprobs
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            choice.finish_reason = "stop" if output.finish_reason == "stop" else "length"
            choice.stop_reason = output.stop_reason
            self.metrics.e2e.observe(now - choice.started)
            self.metrics.requests.labels(outcome=choice.finish_reason).inc()
            self.metrics.generation_tokens.inc(len(output.token_ids))

    def usage(self, prepared: PreparedRequest, choices: list[ChoiceState]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prepared.prompts)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        firsts = [c for c in choices if c.index % len(prepared.params) == 0]  # one per prompt
        cached = sum(min(c.num_cached_tokens, len(prepared.prompts[c.prompt_index])) for c in firsts)
        local = sum(c.num_local_tier_tokens for c in firsts)
        shared = sum(c.num_shared_tier_tokens for c in firsts)
        by_source = {"device": max(0, cached - local - shared), "local": local, "shared": shared}
        # cached_tokens_by_source (a kvyard field): where the cached tokens came from (docs/contracts.md §7)
        details: dict[str, Any] = {"cached_tokens": cached, "cached_tokens_by_source": by_source}
        blended = sum(c.num_blended_tokens for c in firsts)
        if blended:  # a kvyard field: prompt tokens whose KV was moved from elsewhere in a cache (--non-prefix-reuse)
            details["blended_tokens"] = blended
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": details,
        }

    def count_prompt(self, usage: dict[str, Any]) -> None:
        self.metrics.prompt_tokens.inc(usage["prompt_tokens"])
        self.metrics.cached_prompt_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])

    # ------------------------------------------------------------------ non-streaming

    async def complete(self, prepared: PreparedRequest) -> dict[str, Any]:
        choices: dict[int, ChoiceState] = {}
        async for choice, _ in self.stream_outputs(prepared):
            choices[choice.index] = choice
        ordered = [choices[i] for i in sorted(choices)]
        usage = self.usage(prepared, ordered)
        self.count_prompt(usage)
        response: dict[str, Any] = {
            "id": prepared.request_id,
            "object": "chat.completion" if prepared.kind == "chat" else "text_completion",
            "created": prepared.created,
            "model": prepared.model,
            "choices": [self._full_choice(prepared, c) for c in ordered],
            "usage": usage,
        }
        if prepared.kind == "chat" and prepared.prompt_logprobs is not None:  # vLLM: one list, the response's
            response["prompt_logprobs"] = self._prompt_logprobs(ordered[0], prepared.prompt_logprobs)
        return response

    def _full_choice(self, prepared: PreparedRequest, choice: ChoiceState) -> dict[str, Any]:
        base: dict[str, Any] = {
            "index": choice.index,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if prepared.kind != "chat":
            echo = self._echo(prepared, choice) if prepared.echo_texts is not None else ("", [])
            logprobs = None
            if prepared.logprobs is not None:
                logprobs = self._completion_logprobs(choice, [*echo[1], *_entries(choice.logprobs)])
            if prepared.prompt_logprobs is not None:
                base["prompt_logprobs"] = self._prompt_logprobs(choice, prepared.prompt_logprobs)
            return {**base, "text": echo[0] + choice.text, "logprobs": logprobs}
        logprobs = self._logprobs(prepared, choice.logprobs) if prepared.logprobs is not None else None
        text, reasoning = choice.text, None
        if prepared.reasoning is not None:
            split = prepared.reasoning.split(text, True)
            text, reasoning = split.content, split.reasoning or None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = prepared.tools.calls(text, True) if prepared.tools is not None else None
        if prepared.tools is not None and calls:
            content = text[: prepared.tools.content_end(text, True)].strip()
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.json() for c in calls]}
            base["finish_reason"] = _tool_finish_reason(choice.finish_reason)
        if prepared.reasoning is not None:
            message["reasoning_content"] = reasoning
        return {**base, "message": message, "logprobs": logprobs}

    # ------------------------------------------------------------------ streaming

    async def sse_events(self, prepared: PreparedRequest) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per new piece of text, then usage (if asked) and [DONE]. An error after
        the stream started ends it with an error event and no [DONE]."""
        choices: dict[int, ChoiceState] = {}
        # The role chunks go with the first output, as vLLM sends them: a client that times the first token from
        # the first chunk must not see one before prefill. A resumed stream's client has them already.
        role_chunks_due = prepared.kind == "chat" and prepared.resume is None
        try:
            async for choice, output in self.stream_outputs(prepared):
                if role_chunks_due:
                    role_chunks_due = False
                    for index in range(prepared.num_choices):
                        yield _sse(self._chunk(prepared, index, {"role": "assistant", "content": ""}, None, None))
                choices[choice.index] = choice
                chunk = self._delta_chunk(prepared, choice, output)
                if chunk is not None and prepared.continuous_usage:
                    chunk["usage"] = self._running_usage(prepared, choice)
                if chunk is not None:
                    yield _progress(choice) + _sse(chunk) if prepared.stream_progress else _sse(chunk)
        except (APIError, InputError) as error:
            yield _sse((error if isinstance(error, APIError) else APIError.from_input(error)).body())
            return
        ordered = [choices[i] for i in sorted(choices)]
        usage = self.usage(prepared, ordered)
        self.count_prompt(usage)
        if prepared.include_usage:
            yield _sse({**self._envelope(prepared), "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def _running_usage(self, prepared: PreparedRequest, choice: ChoiceState) -> dict[str, int]:
        """vLLM's `continuous_usage_stats`: the choice's tokens so far, on every chunk."""
        prompt_tokens = len(prepared.prompts[choice.prompt_index])
        completion_tokens = len(choice.token_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _delta_chunk(
        self, prepared: PreparedRequest, choice: ChoiceState, output: RequestOutput
    ) -> dict[str, Any] | None:
        # Hold back the last few characters until they cannot start a stop string, so a client never
        # sees text that a later stop match removes.
        holdback = prepared.stop_holdback
        limit = len(choice.text) if output.finished else max(choice.sent_chars, len(choice.text) - holdback)
        new_logprobs: list[TokenLogprobs] = []
        if prepared.logprobs is not None:
            # By position: the engine keeps appending to the list an output carries, so by the time a queued output
            # is read its tail may already hold later tokens' entries.
            start = choice.sent_logprobs
            new_logprobs = choice.logprobs[start : start + len(output.new_token_ids)]
            choice.sent_logprobs = start + len(new_logprobs)
        if prepared.kind != "chat":
            return self._completion_delta_chunk(prepared, choice, limit, output.finished, new_logprobs)
        logprobs = self._logprobs(prepared, new_logprobs) if prepared.logprobs is not None else None
        if prepared.reasoning is not None:
            return self._reasoning_delta_chunk(prepared, choice, limit, output.finished, logprobs)
        if prepared.tools is not None:
            return self._tool_delta_chunk(prepared, choice, limit, output.finished, logprobs)
        delta = choice.text[choice.sent_chars : limit]
        choice.sent_chars = limit
        if not delta and not output.finished and not new_logprobs:
            return None
        return self._chunk(prepared, choice.index, {"content": delta}, choice.finish_reason, logprobs)

    def _completion_delta_chunk(
        self,
        prepared: PreparedRequest,
        choice: ChoiceState,
        limit: int,
        finished: bool,
        new_logprobs: list[TokenLogprobs],
    ) -> dict[str, Any] | None:
        """A completion's next text, after the prompt on the first chunk of an echo."""
        echo_text, echo_entries = "", list[LogprobEntry]()
        if prepared.echo_texts is not None and not choice.echoed:
            choice.echoed = True
            echo_text, echo_entries = self._echo(prepared, choice)
        delta = echo_text + choice.text[choice.sent_chars : limit]
        choice.sent_chars = limit
        entries = [*echo_entries, *_entries(new_logprobs)]
        if not delta and not finished and not entries:
            return None
        logprobs = self._completion_logprobs(choice, entries) if prepared.logprobs is not None else None
        return self._chunk(prepared, choice.index, delta, choice.finish_reason, logprobs)

    def _echo(self, prepared: PreparedRequest, choice: ChoiceState) -> tuple[str, list[LogprobEntry]]:
        """The prompt's text and, with logprobs, its tokens' entries (the first has no logprob)."""
        assert prepared.echo_texts is not None
        prompt = prepared.prompts[choice.prompt_index]
        entries: list[LogprobEntry] = []
        if prepared.logprobs is not None:
            scored = [_top_only(e, prepared.logprobs) for e in choice.prompt_logprobs or [None]]
            entries = [(token_id, scored[i] if i < len(scored) else None) for i, token_id in enumerate(prompt)]
        return prepared.echo_texts[choice.prompt_index], entries

    def _tool_delta_chunk(
        self, prepared: PreparedRequest, choice: ChoiceState, limit: int, finished: bool, logprobs: Any
    ) -> dict[str, Any] | None:
        """A chat with tools streams its content until a call starts, then each call as it completes (a named
        function's arguments as they are generated)."""
        assert prepared.tools is not None
        if choice.tool_stream is None:
            choice.tool_stream = ToolStream(prepared.tools)
        text = choice.text[:limit]
        delta, choice.sent_chars = choice.tool_stream.delta(text, choice.sent_chars, finished)
        if not delta and not finished and logprobs is None:
            return None
        finish_reason = choice.finish_reason
        if choice.tool_stream.sent_calls:
            finish_reason = _tool_finish_reason(finish_reason)
        return self._chunk(prepared, choice.index, delta, finish_reason, logprobs)

    def _reasoning_delta_chunk(
        self, prepared: PreparedRequest, choice: ChoiceState, limit: int, finished: bool, logprobs: Any
    ) -> dict[str, Any] | None:
        """A chat whose thinking is parsed streams it as `reasoning_content`, then its content (or tool calls)."""
        assert prepared.reasoning is not None
        if choice.reasoning_stream is None:
            choice.reasoning_stream = ReasoningStream(prepared.reasoning)
        reasoning, split = choice.reasoning_stream.delta(choice.text[:limit], finished)
        content_sent = choice.sent_chars  # here: characters of the content sent
        finish_reason = choice.finish_reason
        delta: dict[str, Any] = {}
        if prepared.tools is not None:
            if choice.tool_stream is None:
                choice.tool_stream = ToolStream(prepared.tools)
            delta, choice.sent_chars = choice.tool_stream.delta(split.content, content_sent, finished)
            if choice.tool_stream.sent_calls:
                finish_reason = _tool_finish_reason(finish_reason)
        elif len(split.content) > content_sent:
            delta, choice.sent_chars = {"content": split.content[content_sent:]}, len(split.content)
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        if not delta and not finished and logprobs is None:
            return None
        return self._chunk(prepared, choice.index, delta or {"content": ""}, finish_reason, logprobs)

    def _envelope(self, prepared: PreparedRequest) -> dict[str, Any]:
        return {
            "id": prepared.request_id,
            "object": "chat.completion.chunk" if prepared.kind == "chat" else "text_completion",
            "created": prepared.created,
            "model": prepared.model,
        }

    def _chunk(
        self, prepared: PreparedRequest, index: int, delta: Any, finish_reason: str | None, logprobs: Any
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if prepared.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self._envelope(prepared), "choices": [choice]}

    # ------------------------------------------------------------------ logprobs

    def _logprobs(self, prepared: PreparedRequest, entries: list[TokenLogprobs]) -> dict[str, Any]:
        """The chat format of logprobs."""
        decode = self._token_text
        return {
            "content": [
                {
                    "token": decode(e.token_id),
                    "logprob": e.logprob,
                    "bytes": list(decode(e.token_id).encode()),
                    "top_logprobs": [
                        {"token": decode(t), "logprob": lp, "bytes": list(decode(t).encode())}
                        for t, lp in e.top.items()
                    ],
                }
                for e in entries
            ]
        }

    def _completion_logprobs(self, choice: ChoiceState, entries: list[LogprobEntry]) -> dict[str, Any]:
        """The legacy completions format; `text_offset` counts characters of the token strings the choice has
        returned so far, its echoed prompt included."""
        decode = self._token_text
        tokens = [decode(token_id) for token_id, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob if e is not None else None for _, e in entries],
            "top_logprobs": [None if e is None else {decode(t): lp for t, lp in e.top.items()} for _, e in entries],
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, choice: ChoiceState, num_top: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: None for the first token, then for each token a dict by token id of its own
        logprob, rank and text, then those of the `num_top` most likely tokens."""
        return [None if entry is None else self._ranked(entry, num_top) for entry in choice.prompt_logprobs]

    def _ranked(self, entry: TokenLogprobs, num_top: int) -> dict[str, dict[str, Any]]:
        ranked = {str(entry.token_id): self._logprob(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(itertools.islice(entry.top.items(), num_top), start=1):
            ranked[str(token_id)] = self._logprob(token_id, logprob, rank)
        return ranked

    def _logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        # as vLLM clamps them: JSON has no -inf
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": self._token_text(token_id)}

    def _token_text(self, token_id: int) -> str:
        vocabulary = self.engine.vocabulary
        return vocabulary.decode([token_id]) if vocabulary is not None else f"token_id:{token_id}"


LogprobEntry = tuple[int, TokenLogprobs | None]  # a token and its logprobs (None: the prompt's first token)


def _entries(logprobs: list[TokenLogprobs]) -> list[LogprobEntry]:
    return [(entry.token_id, entry) for entry in logprobs]


def _top_only(entry: TokenLogprobs | None, num_top: int) -> TokenLogprobs | None:
    """`entry` with its `num_top` most likely alternatives only (it may have more, for prompt_logprobs)."""
    if entry is None or len(entry.top) <= num_top:
        return entry
    return TokenLogprobs(entry.token_id, entry.logprob, dict(itertools.islice(entry.top.items(), num_top)), entry.rank)


def _tool_finish_reason(finish_reason: str | None) -> str | None:
    """A choice that ends by itself after making calls ends for them."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _progress(choice: ChoiceState) -> bytes:
    """The SSE comment line (clients skip it) that tells a router where the stream stands after the chunk it
    precedes: characters sent so far, the token ids new since the last line, and `end` on the last chunk.
    The router reads it without parsing the chunk's JSON, and drops it."""
    new_ids = ",".join(map(str, choice.token_ids[choice.sent_tokens :]))
    choice.sent_tokens = len(choice.token_ids)
    end = " end" if choice.finish_reason is not None else ""
    return f": progress {choice.sent_chars} {new_ids}{end}\n".encode()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"

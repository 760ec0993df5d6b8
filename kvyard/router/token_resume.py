"""Following a vLLM replica's stream, so that another vLLM replica can finish it from token ids when it fails.

kvyard's replicas resume a stream themselves (`resume`); vLLM cannot, but it accepts a prompt of token ids and,
asked with `return_token_ids`, puts the prompt's token ids in a stream's first chunk and each chunk's new token
ids beside its text. The router asks for them, keeps them, and strips them from what it relays (unless the client
asked for them too); a chunk that carried nothing else is not relayed. When the replica fails mid-stream, the
next one gets a completion request whose prompt is the prompt's tokens plus those generated, asking for what is
left of `max_tokens`. Its chunks are rewritten into the original stream's shape (a chat stream's content deltas,
the original id, creation time and model) and its usage counts the whole answer. A greedy stream continues
exactly as the failed replica would have; a sampled one continues with a fresh draw.

Not followed (a failure mid-stream ends them with an error event): several choices or prompts, tools (the tool
parser's state), structured output (the grammar's state), logprobs, echo, a chat that continues its last message.
Text the failed replica held back (a possible start of a `stop` string) is not sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"
_TOKEN_IDS = b'"token_ids":['
_NO_PROMPT_IDS = b',"prompt_token_ids":null'
_PROMPT_IDS = b'"prompt_token_ids":['
_COMMA = ord(",")
_PLAIN_MIDDLE = b'"finish_reason":null'
# Request fields that mean the same in a completion request and carry over to the resumed one.
_CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "cache_salt",
    "stream_options",
    "user",
    "priority",
    "vllm_xargs",
)
_NOT_FOLLOWED = (
    "tools",
    "functions",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "continue_final_message",
    "suffix",
)


@dataclass(slots=True)
class TokenFollower:
    """The state of one streamed choice of a vLLM replica as the client has received it."""

    kind: str  # the client's request: "chat" or "completion"
    client_asked_ids: bool  # the client itself asked for return_token_ids: relay them
    context_limit: int | None = None  # the model's max_model_len, to bound a resumed request without max_tokens
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    generated_before_resume: int = 0
    stream_id: str | None = None
    created: int | None = None
    model: str | None = None
    relayed: bool = False  # some event reached the client
    ended: bool = False  # [DONE] or an error event reached the client
    answered: bool = False  # the choice's last chunk (with its finish_reason) reached the client
    resuming: bool = False  # the current attempt continues the stream: its completion chunks are rewritten
    _partial: bytes = b""

    @classmethod
    def for_request(cls, kind: str, body: dict[str, Any], context_limit: int | None) -> TokenFollower | None:
        if body.get("stream") is not True or body.get("n", 1) not in (1, None):
            return None
        asked = {name for name in _NOT_FOLLOWED if body.get(name) not in (None, False)}
        if body.get("tool_choice") == "none":
            asked.discard("tools")  # tools the model is told not to call
        if asked:
            return None
        prompt = body.get("prompt")
        if kind == "completion" and isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return None  # a list of prompts is several choices
        return cls(kind, body.get("return_token_ids") is True, context_limit)

    @property
    def kinds(self) -> frozenset[str]:
        """The replicas that can resume it: vLLM's (they take token-id prompts and return token ids)."""
        return frozenset({"vllm"})

    @property
    def resumable(self) -> bool:
        return self.prompt_ids is not None and not (self.answered or self.ended)

    def upstream_path(self, path: str) -> str:
        return "/v1/completions" if self.relayed else path

    def upstream_body(self, body: dict[str, Any]) -> bytes:
        if not self.relayed:
            return orjson.dumps({**body, "return_token_ids": True})
        assert self.prompt_ids is not None
        resumed = {name: body[name] for name in _CARRIED if name in body}
        resumed.update(prompt=[*self.prompt_ids, *self.generated], stream=True, return_token_ids=True)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(limit, int):
            resumed["max_tokens"] = max(1, limit - len(self.generated))
        elif self.context_limit is not None:
            resumed["max_tokens"] = max(1, self.context_limit - len(resumed["prompt"]))
        if isinstance(body.get("min_tokens"), int):
            resumed["min_tokens"] = max(0, body["min_tokens"] - len(self.generated))
        return orjson.dumps(resumed)

    def start_attempt(self) -> None:
        self._partial = b""  # the half event of a replica that failed never reaches the client
        self.resuming = self.relayed
        self.generated_before_resume = len(self.generated)

    def feed(self, data: bytes) -> bytes:
        """The complete events in `data` (and what came before it), as the client gets them."""
        if self._partial:
            data = self._partial + data
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._partial = data
            return b""
        cut = end + len(_EVENT_END)
        self._partial = data[cut:]
        out = [self._event(event) for event in data[:cut].split(_EVENT_END) if event]
        relayed = b"".join(out)
        self.relayed = self.relayed or bool(relayed)
        return relayed

    def _event(self, event: bytes) -> bytes:
        if not self.resuming and self.stream_id is not None and not self.client_asked_ids:
            relayed = self._token_chunk(event)
            if relayed is not None:
                return relayed
        if event.startswith(_DONE):
            self.ended = True
            return event + _EVENT_END
        if not event.startswith(_DATA):
            return event + _EVENT_END  # a comment or another field: passed on as it is
        try:
            chunk = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event + _EVENT_END
        if not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") == "error":
            self.ended = True
            return event + _EVENT_END
        chunk = self._resumed_chunk(chunk) if self.resuming else self._original_chunk(chunk)
        return _DATA + orjson.dumps(chunk) + _EVENT_END if chunk is not None else b""

    def _token_chunk(self, event: bytes) -> bytes | None:
        """A chunk in the middle of the stream (one token's text, nothing ending), read and stripped as bytes: most
        chunks of a stream are these, and parsing and writing each as JSON cost more than relaying it. None when the
        chunk is not that plain; `_original_chunk` reads it then. A key's quotes cannot occur unescaped inside a
        JSON string, so the byte patterns below only match keys."""
        if _PLAIN_MIDDLE not in event or b'"usage"' in event or b'"error"' in event or _PROMPT_IDS in event:
            return None
        start = event.find(_TOKEN_IDS)
        end = event.find(b"]", start)
        if start < 1 or end < 0 or event[start - 1] != _COMMA or event.find(_TOKEN_IDS, end) >= 0:
            return None
        ids = event[start + len(_TOKEN_IDS) : end]
        if ids:
            if not ids.replace(b",", b"").isdigit():
                return None
            self.generated.extend(map(int, ids.split(b",")))
        stripped = event[: start - 1] + event[end + 1 :]
        if b'"delta":{}' in stripped if self.kind == "chat" else b'"text":"",' in stripped:
            return b""  # sent only for its token ids
        return stripped.replace(_NO_PROMPT_IDS, b"", 1) + _EVENT_END

    def _original_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if self.stream_id is None:
            self.stream_id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        prompt_ids = chunk.get("prompt_token_ids") if self.client_asked_ids else chunk.pop("prompt_token_ids", None)
        choices = chunk.get("choices") or []
        for choice in choices:
            prompt_ids = prompt_ids or (
                choice.get("prompt_token_ids") if self.client_asked_ids else choice.pop("prompt_token_ids", None)
            )
            token_ids = choice.get("token_ids") if self.client_asked_ids else choice.pop("token_ids", None)
            self.generated.extend(token_ids or ())
            self.answered = self.answered or choice.get("finish_reason") is not None
        if prompt_ids and self.prompt_ids is None:
            self.prompt_ids = list(prompt_ids)
        if choices and not self.client_asked_ids and all(_carries_nothing(self.kind, c) for c in choices):
            return None if chunk.get("usage") is None else chunk
        return chunk

    def _resumed_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """A chunk of the resuming completion request, in the original stream's shape."""
        out: dict[str, Any] = {
            "id": self.stream_id,
            "object": _OBJECT[self.kind],
            "created": self.created,
            "model": self.model or chunk.get("model"),
        }
        choices = []
        for choice in chunk.get("choices") or ():
            token_ids = choice.get("token_ids") or []
            self.generated.extend(token_ids)
            finish = choice.get("finish_reason")
            self.answered = self.answered or finish is not None
            text = choice.get("text") or ""
            if not text and finish is None:
                continue
            rewritten: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if self.kind == "chat":
                rewritten["delta"] = {"content": text} if text else {}
            else:
                rewritten["text"] = text
                rewritten["stop_reason"] = choice.get("stop_reason")
            if self.client_asked_ids:
                rewritten["token_ids"] = token_ids
            choices.append(rewritten)
        out["choices"] = choices
        usage = chunk.get("usage")
        if usage is not None:
            out["usage"] = self._usage(usage)
        return out if choices or usage is not None else None

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole answer's usage: the original prompt, and every token generated on either replica."""
        prompt_tokens = len(self.prompt_ids or ())
        completion = self.generated_before_resume + int(usage.get("completion_tokens") or 0)
        counted = {
            **usage,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            counted["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt_tokens),
            }
        return counted


_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


def _carries_nothing(kind: str, choice: dict[str, Any]) -> bool:
    """A chunk that was sent only for its token ids (vLLM sends one for every token when asked for them)."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if kind == "chat":
        return not choice.get("delta")
    return not choice.get("text")

"""Token ids of a request's prompt, as the replica itself will see them.

Token-id prompts are used as they are. Text prompts and chat messages are tokenized by a replica's own
`/tokenize` (chat template included), never by a tokenizer of the router's, so router and engine cannot
disagree about the tokens. Results are cached per model; a model whose replicas cannot tokenize is
remembered for a while and routed without a prefix prediction (the parity metric then shows 0 predicted).
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvyard.net.http_client import HttpError
from kvyard.router.replica import Replica

_LOG = logging.getLogger(__name__)
NO_TOKENIZER_RETRY_S = 30.0


def direct_token_ids(kind: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids when the request gives them itself (well-formed ones only: the replica answers
    the malformed with a 400 naming the field)."""
    if kind != "completion":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not isinstance(prompt, list) or not prompt:
        return None
    try:  # at C speed: every item an integer that fits the uint32 of a block key
        array("I", prompt)
    except (TypeError, OverflowError):
        return None
    return prompt


def estimated_tokens_asked(kind: str, body: dict[str, Any]) -> int:
    """Prompt plus max_tokens over the request's choices, for tokens-per-minute limits: exact for token-id
    prompts, about four characters a token for text (the router does not tokenize to rate-limit)."""
    direct = direct_token_ids(kind, body)
    if direct is not None:
        prompt_tokens = len(direct)
    elif kind == "chat":
        messages = body.get("messages")
        contents = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        prompt_tokens = sum(len(str(content or "")) for content in contents) // 4
    else:
        prompt = body.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
        prompt_tokens = sum(len(t) if isinstance(t, list) else len(str(t)) // 4 for t in texts)
    n = body.get("n")
    return (prompt_tokens + max_tokens_asked(body, 16)) * (n if type(n) is int and n > 0 else 1)


def max_tokens_asked(body: dict[str, Any], default: int) -> int:
    """The request's output limit (max_completion_tokens, else max_tokens), or `default` when it sets none."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return limit if type(limit) is int and limit > 0 else default


def tokenize_payload(kind: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """What to send to `/tokenize` for this request, or None when it cannot be tokenized as one prompt."""
    model = body.get("model")
    if kind == "chat":
        messages = body.get("messages")
        if not messages:
            return None
        payload = {"model": model, "messages": messages, "add_generation_prompt": True}
        if body.get("tools") and body.get("tool_choice") != "none":  # the replica renders them into the prompt
            payload["tools"] = body["tools"]
        return payload
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return {"model": model, "prompt": prompt, "add_special_tokens": True} if isinstance(prompt, str) else None


@dataclass(slots=True)
class Tokenizer:
    """Token ids by a digest of the tokenize request. They are kept as uint32 arrays: half a list's memory, and
    never walked by the garbage collector (a router's cache holds tens of millions of token ids; as lists they
    made its full collections take hundreds of milliseconds)."""

    capacity: int = 8192
    _cache: OrderedDict[bytes, array[int]] = field(default_factory=OrderedDict)
    _unavailable_until: dict[str, float] = field(default_factory=dict)

    async def token_ids(self, kind: str, body: dict[str, Any], replicas: list[Replica]) -> Sequence[int] | None:
        direct = direct_token_ids(kind, body)
        if direct is not None:
            return direct
        payload = tokenize_payload(kind, body)
        if payload is None or not replicas:
            return None
        model = str(payload["model"])
        if self._unavailable_until.get(model, 0.0) > time.monotonic():
            return None
        cache_key = hashlib.blake2b(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
        cached = self._cache.get(cache_key)
        if cached is not None:
            self._cache.move_to_end(cache_key)
            return cached
        tokens, supported = await self._ask(replicas, payload)
        if tokens is None:
            if not supported:
                self._unavailable_until[model] = time.monotonic() + NO_TOKENIZER_RETRY_S
            return None
        self._cache[cache_key] = tokens
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return tokens

    async def _ask(self, replicas: list[Replica], payload: dict[str, Any]) -> tuple[array[int] | None, bool]:
        """(token ids or None, whether the replicas can tokenize at all: a 400 is the request's fault)."""
        supported = False
        request = orjson.dumps(payload)
        for replica in replicas[:2]:
            headers = {"Content-Type": "application/json", **replica.api_headers}
            try:
                response = await replica.http.request("POST", "/tokenize", request, timeout=10, headers=headers)
                supported = supported or response.status in (200, 400, 422)
                if response.status != 200:
                    continue
                # At C speed, each an integer that fits a block key's uint32 (a 100k-token prompt: 0.4 ms, not 4)
                return array("I", orjson.loads(response.body)["tokens"]), True
            except (HttpError, TimeoutError, ValueError, KeyError, TypeError, OverflowError) as error:
                _LOG.debug("tokenize at %s failed: %s", replica.url, error)
                supported = True  # unreachable is not unsupported
        return None, supported

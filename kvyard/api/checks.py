"""Checks of user input that every replica applies the same way, engine and simulator alike.

Each raises `InputError` naming the field, so the offline API gets a `ValueError` and the HTTP API
a 400 with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvyard.api.errors import InputError


@dataclass(frozen=True, slots=True)
class ContextLimits:
    """What one replica can hold: the model's context, its vocabulary and its pool of KV blocks."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str = "prompt", param: str = "prompt") -> None:
    """Non-empty, and every id inside the vocabulary."""
    if not token_ids:
        raise InputError(f"{what} is empty: at least one token is required", param)
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InputError(f"{what} has token id {bad} outside the vocabulary [0, {vocab_size})", param)


def check_prompt(token_ids: Sequence[int], limits: ContextLimits, what: str = "prompt") -> None:
    """A prompt the replica can start: valid ids, and room for at least one generated token."""
    check_token_ids(token_ids, limits.vocab_size, what)
    if len(token_ids) >= limits.max_model_len:
        raise InputError(
            f"{what} has {len(token_ids)} tokens; the model's context is {limits.max_model_len} tokens "
            "and at least one must be left to generate",
            "prompt",
            "context_length_exceeded",
        )


def check_kv_room(num_prompt_tokens: int, max_tokens: int, limits: ContextLimits) -> None:
    """A sequence that may grow to prompt plus `max_tokens` (capped at the context) fits in the KV pool when
    alone; the error blames the prompt when it alone does not fit."""
    pool = limits.num_kv_blocks
    if limits.blocks_for(num_prompt_tokens + 1) > pool:
        raise InputError(
            f"prompt has {num_prompt_tokens} tokens and with one generated token needs "
            f"{limits.blocks_for(num_prompt_tokens + 1)} KV blocks, but the pool has {pool}",
            "prompt",
            "kv_capacity_exceeded",
        )
    needed = limits.blocks_for(min(num_prompt_tokens + max_tokens, limits.max_model_len))
    if needed > pool:
        raise InputError(
            f"prompt plus max_tokens needs {needed} KV blocks but the pool has {pool}",
            "max_tokens",
            "kv_capacity_exceeded",
        )


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, limits: ContextLimits) -> int:
    """The API's rule: no `max_tokens` means as many as the context and the KV pool allow; asking for more
    than the context holds is an error (the offline engine instead stops at the context's end)."""
    if max_tokens is None:
        room = min(limits.max_model_len, limits.kv_capacity_tokens)
        max_tokens = room - num_prompt_tokens
        if max_tokens < 1:
            raise InputError(
                f"prompt has {num_prompt_tokens} tokens; the model's context (and KV pool) holds {room} "
                "tokens and at least one must be left to generate",
                "prompt",
                "context_length_exceeded",
            )
    if num_prompt_tokens >= limits.max_model_len:
        raise InputError(
            f"prompt has {num_prompt_tokens} tokens; the model's context is {limits.max_model_len} "
            "tokens and at least one must be left to generate",
            "prompt",
            "context_length_exceeded",
        )
    if num_prompt_tokens + max_tokens > limits.max_model_len:
        raise InputError(
            f"this model's maximum context length is {limits.max_model_len} tokens; the request has "
            f"{num_prompt_tokens} prompt tokens and max_tokens {max_tokens}",
            "max_tokens",
            "context_length_exceeded",
        )
    check_kv_room(num_prompt_tokens, max_tokens, limits)
    return max_tokens


def check_sampling_token_ids(stop_token_ids: Sequence[int], logit_bias_ids: Sequence[int], vocab_size: int) -> None:
    """Token ids in the sampling parameters index the logits: each must be inside the vocabulary."""
    for token_ids, param in ((stop_token_ids, "stop_token_ids"), (logit_bias_ids, "logit_bias")):
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InputError(f"{param} has token id {bad} outside the vocabulary [0, {vocab_size})", param)

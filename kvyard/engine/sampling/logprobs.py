"""A token's log-probability, as the sampler computes it and responses report it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: dict[int, float]  # the most likely tokens, most likely first
    rank: int | None = None  # the token's rank in the vocabulary, 1 the most likely (prompt logprobs have it)

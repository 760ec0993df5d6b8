"""A proposer for tests and benchmarks of speculative decoding: it knows each prompt's greedy continuation and
proposes it, each token replaced by a wrong one with probability `error_rate`, so the acceptance rate is set
from outside (random-weight models do not repeat their prompts the way trained ones re-emit code)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvyard.engine.scheduling.request import Request


@dataclass(slots=True)
class OracleProposer:
    continuations: dict[tuple[int, ...], list[int]]  # prompt token ids -> the greedy output without speculation
    error_rate: float
    rng: random.Random = field(default_factory=lambda: random.Random(5))
    proposed: int = 0

    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(request, room) if room > 0 else [] for request, room in zip(requests, rooms)]

    def seconds_per_proposal(self, num_sequences: int) -> float:
        return 0.0

    def propose_one(self, request: Request, max_tokens: int) -> list[int]:
        known = self.continuations[tuple(request.prompt_token_ids)]
        ahead = known[request.num_output_tokens : request.num_output_tokens + max_tokens]
        # token ^ 1 differs from token and stays inside the vocabulary (an even size, or the last id even)
        guesses = [token if self.rng.random() >= self.error_rate else token ^ 1 for token in ahead]
        self.proposed += len(guesses)
        return guesses

    def release(self, request: Request) -> None:
        pass

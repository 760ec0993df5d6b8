"""Speculative decoding: a cheap proposer guesses the next tokens of a decoding request, the model computes them
all in one pass, and the guesses that agree with what the model would have produced are kept.

The engine (core and scheduler) schedules a decoding request's last token plus its proposed tokens as one
query; the runner samples at every position; `accept_greedy` keeps the longest run of proposals the model
agrees with, plus the model's own next token, so under greedy decoding the output is exactly the output
without speculation. Rejected positions are never counted as computed: their KV slots are overwritten by the
tokens that do come, and no block holding them is entered into the prefix cache.

Proposers here: `ngram` (prompt lookup: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from `ngram_max` down to `ngram_min`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvyard.engine.request import Request
from kvyard.settings import setting

METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (greedy requests): who proposes tokens, and how many per step."""

    method: str | None = setting(None, flag="--speculative", choices=METHODS, help="propose tokens for the model "
                                 "to verify in one pass: ngram (prompt lookup)", default_text="none: off")  # fmt: skip
    num_speculative_tokens: int = setting(4, help="tokens proposed per decode step of a request")
    ngram_min: int = setting(1, help="ngram: shortest suffix looked up in the sequence")
    ngram_max: int = setting(4, help="ngram: longest suffix looked up in the sequence")

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")


class Proposer(Protocol):
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens after `request.all_token_ids` (may be none)."""
        ...

    def release(self, request: Request) -> None:
        """The request is done: drop what was kept for it."""
        ...


@dataclass(slots=True)
class _NgramIndex:
    """Where each n-gram of one sequence last started, for the tokens seen so far."""

    num_indexed: int = 0  # tokens whose n-grams ending there are in `last_start`
    last_start: dict[tuple[int, ...], int] = field(default_factory=dict)


@dataclass(slots=True)
class NgramProposer:
    """Prompt lookup: the sequence's last n tokens appeared before; propose what followed them then."""

    ngram_min: int = 1
    ngram_max: int = 4
    _indexes: dict[str, _NgramIndex] = field(default_factory=dict)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tokens = request.all_token_ids
        index = self._indexes.setdefault(request.request_id, _NgramIndex())
        # The suffix itself is indexed last, after the lookup, so a match is always an earlier occurrence.
        self._index_up_to(index, tokens, len(tokens) - 1)
        proposal: list[int] = []
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            start = index.last_start.get(tuple(tokens[-n:]))
            if start is not None:
                proposal = tokens[start + n : start + n + max_tokens]
                break
        self._index_up_to(index, tokens, len(tokens))
        return proposal

    def _index_up_to(self, index: _NgramIndex, tokens: Sequence[int], end: int) -> None:
        for stop in range(index.num_indexed + 1, end + 1):  # n-grams ending just before `stop`
            for n in range(self.ngram_min, min(self.ngram_max, stop) + 1):
                index.last_start[tuple(tokens[stop - n : stop])] = stop - n
        index.num_indexed = max(index.num_indexed, end)

    def release(self, request: Request) -> None:
        self._indexes.pop(request.request_id, None)


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    return None


def accept_greedy(proposed: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits: `targets[i]` is the model's token after the query's i-th position
    (its last known token, then each proposal); proposals are kept while they equal the model's choice, and the
    model's own token follows the last kept one."""
    accepted = 0
    while accepted < len(proposed) and proposed[accepted] == targets[accepted]:
        accepted += 1
    return [*proposed[:accepted], targets[accepted]]


def can_speculate(request: Request) -> bool:
    """Greedy requests decoding one token at a time, with no logprobs asked and no token banned right now
    (those change what a position samples)."""
    params = request.sampling_params
    return (params.is_greedy and params.logprobs is None and request.num_tokens - request.num_computed_tokens == 1
            and not request.banned_token_ids() and request.kv_transfer is None)  # fmt: skip

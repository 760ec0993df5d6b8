"""Speculative decoding: a cheap proposer guesses the next tokens of a decoding request, the model computes them
all in one pass, and the guesses that agree with what the model would have produced are kept.

The engine (core and scheduler) schedules a decoding request's last token plus its proposed tokens as one query; the
runner samples every position as it would without speculation (greedy, or drawn with the generator of that output
position), and its `accept_greedy` (kvyard.engine.runners.model_runner) keeps the proposals equal to what was
sampled, plus the sampled token after the last one kept. Every emitted token is the token plain decoding would have
produced at its position: greedy and seeded outputs are exactly those without speculation, unseeded ones follow the
same distribution (for a point guess this keeps it with the model's probability of it, as rejection sampling would).
Rejected positions are never counted as computed: their KV slots are overwritten by the tokens that do come, and no
block holding them is entered into the prefix cache.

How many tokens a request proposes adapts to how often its guesses were right: with an estimated per-token
acceptance a, k proposals emit 1 + a + a^2 + ... + a^k tokens for a step that costs 1 + c*k decode steps (c:
`verify_token_cost`, or what the engine measures: `StepCost`), and the k that gives the most tokens per unit of
cost is taken, 0 when none beats plain decoding; a request at 0 still proposes one token after `PROBE_EVERY`
steps, so it notices when guessing starts to pay, and waits twice as long after each probe that did not change
that (up to `MAX_PROBE_INTERVAL`): a probe of a model proposer costs a pass of it.

Proposers: `ngram` (here; prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for n from `ngram_max` down to `ngram_min`), `draft` (`draft_proposer`: a smaller model, run greedily
on a paged KV cache of its own) and `self-int8` / `self-fp16` (`self_draft`: the target's own weights in int8 or fp16,
run greedily over the target's KV cache). A proposer that costs time says how much (`seconds_per_proposal`), and
that cost joins the verify cost when k is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvyard.engine.scheduling.request import Request
from kvyard.settings import setting

METHODS = ("ngram", "draft", "self-int8", "self-fp16")
MODEL_METHODS = ("draft", "self-int8", "self-fp16")  # proposers that run a model, built by the engine that has one
PROBE_EVERY = 8  # steps before the first single-token probe of a request whose speculation stopped paying
MAX_PROBE_INTERVAL = 64  # the longest wait between probes
INITIAL_ACCEPTANCE = 0.5  # the first request's acceptance estimate; later ones start at the engine's recent one
ACCEPTANCE_WEIGHT = 0.3  # how far one step's outcome moves a request's acceptance estimate


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens, and how many per step."""

    method: str | None = setting(
        None,
        flag="--speculative",
        choices=METHODS,
        help="propose tokens for the model "
        "to verify in one pass: ngram (prompt lookup), draft (a smaller model with the same "
        "vocabulary: --draft-model), self-int8 / self-fp16 (the model's own weights in int8 "
        "or fp16)",
        default_text="none: off",
    )
    num_speculative_tokens: int = setting(4, help="tokens proposed per decode step of a request")
    ngram_min: int = setting(1, help="ngram: shortest suffix looked up in the sequence")
    ngram_max: int = setting(4, help="ngram: longest suffix looked up in the sequence")
    draft_model: str | None = setting(
        None, help="draft: the model directory that proposes (same tokenizer and vocabulary as the served model)"
    )
    max_draft_catch_up: int = setting(
        512,
        help="draft: prompt tokens the draft model may prefill per step (a new "
        "request's prompt is caught up over several steps; a self-draft reads the "
        "model's KV and has none to catch up)",
    )
    adaptive: bool = setting(
        True,
        flag="--spec-adaptive",
        help="propose fewer tokens (down to none) for a request whose guesses are often wrong",
    )
    verify_token_cost: float = setting(
        0.1,
        help="what verifying one more token adds to a decode step, as a fraction "
        "of it, until the engine has measured its steps",
    )

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "--speculative draft needs --draft-model DIR"
                if self.method == "draft"
                else "--draft-model is used only with --speculative draft"
            )
        if self.max_draft_catch_up < 1:
            raise ValueError(f"max_draft_catch_up must be at least 1, got {self.max_draft_catch_up}")


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        """For each request, up to `rooms[i]` guesses of the tokens after its `all_token_ids` (may be none)."""
        ...

    def seconds_per_proposal(self, num_sequences: int) -> float:
        """What proposing one more token for each of `num_sequences` requests costs a step, measured (0.0: nothing
        worth counting)."""
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

    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(request, room) if room > 0 else [] for request, room in zip(requests, rooms)]

    def seconds_per_proposal(self, num_sequences: int) -> float:
        return 0.0

    def propose_one(self, request: Request, max_tokens: int) -> list[int]:
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
    """The proposer that needs no model (None: speculation off); model proposers come from the engine."""
    if config.method in MODEL_METHODS:
        raise ValueError(f"speculative method {config.method!r} runs a model: only an engine on a model builds it")
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    return None


@dataclass(slots=True)
class StepCost:
    """Step time as a + b * tokens, fitted by least squares over recent steps (each new step weighs a little more
    than the last), so the cost of verifying proposals follows the batch: one sequence's step is mostly the fixed
    part a (reading the weights), eight sequences' is more the per-token part."""

    decay: float = 0.98
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weights, x, y, xx, xy

    def observe(self, num_tokens: int, seconds: float) -> None:
        x, y = float(num_tokens), seconds
        self._sums = [s * self.decay + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def step_seconds(self, num_tokens: int) -> float | None:
        """The fitted time of a step of `num_tokens` tokens (None until the fit is usable)."""
        line = self._line()
        return None if line is None else line[0] + line[1] * num_tokens

    def verify_token_cost(self, num_sequences: int) -> float | None:
        """What one more token per sequence adds to a step of `num_sequences` decoding sequences, as a fraction of
        that step (None until the fit is usable)."""
        line = self._line()
        if line is None:
            return None
        fixed, per_token = line
        return per_token * num_sequences / (fixed + per_token * num_sequences)

    def _line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of the fit, once it has points enough and both are positive."""
        weight, x, y, xx, xy = self._sums
        if weight < 4:
            return None
        variance = xx / weight - (x / weight) ** 2
        if variance <= 1e-9:
            return None
        per_token = (xy / weight - x * y / weight**2) / variance
        fixed = y / weight - per_token * x / weight
        return (fixed, per_token) if per_token > 0 and fixed > 0 else None


def num_tokens_to_propose(acceptance: float, max_tokens: int, verify_token_cost: float) -> int:
    """The number of proposals that gives the most emitted tokens per unit of step cost (0: speculation does not
    pay at this acceptance)."""
    best_k, best_rate = 0, 1.0
    expected = 1.0
    for k in range(1, max_tokens + 1):
        expected += acceptance**k
        rate = expected / (1 + verify_token_cost * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def updated_acceptance(acceptance: float, proposed: int, accepted: int) -> float:
    """The per-token acceptance estimate after one verification: guesses are kept up to the first wrong one, so a
    step shows `accepted` successes and one failure (none when every guess was kept)."""
    trials = accepted + (1 if accepted < proposed else 0)
    return acceptance + ACCEPTANCE_WEIGHT * (accepted / trials - acceptance)


def can_speculate(request: Request) -> bool:
    """Requests that allow it (`speculate`), decoding one token at a time, with no token banned right now and no
    grammar (those change what a position samples). Logprobs are fine: each position's row yields its own."""
    params = request.sampling_params
    return (
        params.speculate
        and request.num_tokens - request.num_computed_tokens == 1
        and not request.banned_token_ids()
        and request.kv_transfer is None
        and request.grammar is None
    )

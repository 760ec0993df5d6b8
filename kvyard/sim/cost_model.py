"""How long one scheduler step of a simulated replica takes: pure arithmetic, no clock.

A step runs a batch of prefill chunks and decode tokens together, as the engine does:

    seconds = step_base_s                                     weights read once per forward pass
            + prefill_token_s       * prefill tokens            linear layers of every new prompt token
            + attention_pair_s      * (query, key) pairs        causal attention of the prefill chunks
            + decode_seq_s          * decoding sequences        linear layers + logits of one token each
            + decode_context_s      * context tokens read       attention of each decode token

A prefill chunk of `n` new tokens after `c` computed ones attends to `n*c + n*(n+1)/2` pairs, so a
long uncached prompt costs a linear plus a quadratic term.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, summed over its batch."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decode_seqs: int = 0
    decode_context_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0


def prefill_pairs(num_new: int, num_context: int) -> int:
    """(query, key) pairs of a causal prefill chunk of `num_new` tokens after `num_context` computed ones."""
    return num_new * num_context + num_new * (num_new + 1) // 2


@dataclass(frozen=True, slots=True)
class CostModel:
    # Defaults: `calibrate_from_json(benchmarks/results/offline_throughput.json)` (kvyard engine, bench
    # preset, fp32, 2 CPU cores), rounded. tests/test_sim_cost_model.py checks they still agree.
    step_base_s: float = 1.58e-2
    prefill_token_s: float = 4.33e-4
    attention_pair_s: float = 1.50e-7
    decode_seq_s: float = 1.83e-3
    decode_context_s: float = 1.50e-7

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not value >= 0:
                raise ValueError(f"cost model: {item.name} must be a non-negative number, got {value}")

    def step_seconds(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        return (
            self.step_base_s
            + self.prefill_token_s * shape.prefill_tokens
            + self.attention_pair_s * shape.prefill_pairs
            + self.decode_seq_s * shape.decode_seqs
            + self.decode_context_s * shape.decode_context_tokens
        )

    def prefill_seconds(self, num_new: int, num_cached: int = 0) -> float:
        """One request's prefill of `num_new` uncached tokens after `num_cached` cached ones, alone, in one step."""
        return self.step_seconds(StepShape(prefill_tokens=num_new, prefill_pairs=prefill_pairs(num_new, num_cached)))

    def decode_step_seconds(self, num_seqs: int, context_tokens: int) -> float:
        """A decode-only step of `num_seqs` sequences holding `context_tokens` tokens in all."""
        return self.step_seconds(StepShape(decode_seqs=num_seqs, decode_context_tokens=context_tokens))

    def scaled(self, factor: float) -> CostModel:
        """Every term multiplied by `factor` (a faster or slower replica)."""
        return CostModel(**{name: value * factor for name, value in asdict(self).items()})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

"""Fit a `CostModel` to a kvyard engine benchmark (`benchmarks/offline_throughput.py`'s result JSON).

Three measured scenarios pin the five constants:

* `prefill` (one long prompt, one step): base + linear + attention terms of a full prefill;
* `decode` (one stream): the step time of a one-sequence decode, 1 / decode tok/s;
* `batch` (many prompts at once): with the token budget of the run, it fixes the per-sequence
  decode cost, found by replaying an equivalent workload on the simulated scheduler (virtual
  clock) and searching until its wall time matches the measured one.

The attention term per (query, key) pair is tied to the linear term per token by the model's
FLOP ratio (`4·layers·heads·head_dim` per pair against `2·linear parameters` per token), since one
prefill length alone cannot separate them; decode attention uses the same cost per context token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.sim.config import SimConfig
from kvyard.sim.cost_model import CostModel, prefill_pairs
from kvyard.sim.virtual_run import Arrival, run_virtual

# FLOP ratio of the `bench` preset (hidden 512, 8 layers, 8/4 heads of 64, intermediate 1408).
DEFAULT_ATTENTION_RATIO = 16384 / 47185920
_SOLVER_STEPS = 40
_SOLVER_TOLERANCE_S = 1e-6


class CalibrationError(ValueError):
    """The benchmark JSON lacks a scenario or field the fit needs."""


@dataclass(frozen=True, slots=True)
class Calibration:
    cost: CostModel
    max_num_batched_tokens: int
    source: dict[str, Any] = field(default_factory=dict)  # the measurements used and the fit's residual


def calibrate_from_json(path: str | Path, engine: str = "kvyard") -> Calibration:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CalibrationError(f"cannot read benchmark JSON {path}: {error}") from error
    return calibrate(report, engine)


def calibrate(report: Mapping[str, Any], engine: str = "kvyard") -> Calibration:
    result = _field(report, "engines", engine)
    scenarios = _field(result, "scenarios")
    prefill, decode, batch = (_field(scenarios, name) for name in ("prefill", "decode", "batch"))
    budget = int(result.get("config", {}).get("max_num_batched_tokens", 2048))
    ratio = attention_ratio(report.get("conditions", {}).get("model"))

    prefill_tokens = int(_field(prefill, "input_tokens"))
    prefill_s = prefill_tokens / float(_field(prefill, "prefill_tok_s"))
    decode_step_s = 1.0 / float(_field(decode, "decode_tok_s"))
    decode_context = int(_field(decode, "input_tokens")) + (int(_field(decode, "output_tokens")) + 1) // 2
    fit = _Fit(prefill_tokens, prefill_s, decode_step_s, decode_context, ratio)

    workload = report.get("conditions", {}).get("workload", {}).get("batch", {})
    lengths = _batch_lengths(batch, workload)
    target_s = float(_field(batch, "wall_s"))
    cost = fit.cost(_solve(lambda seq_s: _replay_seconds(fit.cost(seq_s), lengths, budget) - target_s, decode_step_s))
    source = {
        "engine": engine,
        "prefill": {"tokens": prefill_tokens, "seconds": prefill_s},
        "decode": {"step_seconds": decode_step_s, "context_tokens": decode_context},
        "batch": {"prompts": len(lengths), "seconds": target_s, "fit_seconds": _replay_seconds(cost, lengths, budget)},
        "attention_ratio": ratio,
        "max_num_batched_tokens": budget,
    }
    return Calibration(cost, budget, source)


def attention_ratio(model: Mapping[str, Any] | None) -> float:
    """Cost of one attention (query, key) pair relative to one token through the linear layers."""
    try:
        assert model is not None
        hidden, layers = int(model["hidden_size"]), int(model["num_hidden_layers"])
        heads, kv_heads = int(model["num_attention_heads"]), int(model["num_key_value_heads"])
        head_dim = int(model.get("head_dim") or hidden // heads)
        intermediate = int(model["intermediate_size"])
    except (AssertionError, KeyError, TypeError, ValueError):
        return DEFAULT_ATTENTION_RATIO
    attention_projections = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    linear_params = layers * (attention_projections + 3 * hidden * intermediate)
    return (4 * layers * heads * head_dim) / (2 * linear_params)


@dataclass(frozen=True, slots=True)
class _Fit:
    """The constants as functions of the per-sequence decode cost, the one left to bisect."""

    prefill_tokens: int
    prefill_s: float
    decode_step_s: float
    decode_context: int
    ratio: float

    def cost(self, decode_seq_s: float) -> CostModel:
        # decode_step_s = base + decode_seq_s + ratio·a·context;  prefill_s = base + a·tokens + ratio·a·pairs
        pairs = prefill_pairs(self.prefill_tokens, 0)
        per_token = (self.prefill_s - self.decode_step_s + decode_seq_s) / (
            self.prefill_tokens + self.ratio * (pairs - self.decode_context)
        )
        per_token = max(per_token, 0.0)
        per_pair = self.ratio * per_token
        base = max(0.0, self.decode_step_s - decode_seq_s - per_pair * self.decode_context)
        return CostModel(base, per_token, per_pair, decode_seq_s, per_pair)


def _solve(error: Callable[[float], float], high: float) -> float:
    """The root of an increasing `error` in [0, high] (clamped to the ends), by the Illinois method."""
    low, error_low, error_high = 0.0, error(0.0), error(high)
    if error_low >= 0:
        return low
    if error_high <= 0:
        return high
    side = 0
    for _ in range(_SOLVER_STEPS):
        guess = (low * error_high - high * error_low) / (error_high - error_low)
        error_guess = error(guess)
        if abs(error_guess) < _SOLVER_TOLERANCE_S:
            return guess
        if error_guess < 0:
            low, error_low = guess, error_guess
            if side == -1:
                error_high /= 2
            side = -1
        else:
            high, error_high = guess, error_guess
            if side == 1:
                error_low /= 2
            side = 1
    return (low + high) / 2


def _replay_seconds(cost: CostModel, lengths: list[tuple[int, int]], max_num_batched_tokens: int) -> float:
    """Wall time of the batch on the simulated engine: every prompt at once, a cache that holds them all."""
    total_tokens = sum(i + o for i, o in lengths)
    block_size = SimConfig().block_size
    config = SimConfig(
        num_kv_blocks=-(-total_tokens // block_size) + len(lengths),
        cost=cost,
        scheduler=SchedulerConfig(max_num_batched_tokens),
        vocab_size=total_tokens + 1,
    )
    arrivals, offset = [], 0
    for index, (input_len, output_len) in enumerate(lengths):
        prompt = list(range(offset, offset + input_len))  # distinct tokens: a cold cache, as measured
        offset += input_len
        arrivals.append(Arrival(0.0, f"c{index}", prompt, output_len))
    times = run_virtual(*config.build_core(), arrivals)
    return max(t.finished or 0.0 for t in times.values())


def _batch_lengths(batch: Mapping[str, Any], workload: Mapping[str, Any]) -> list[tuple[int, int]]:
    """Prompt and output lengths spread evenly over the workload's ranges, with the measured totals."""
    count = int(_field(batch, "num_prompts"))
    inputs = _spread(int(_field(batch, "input_tokens")), count, workload.get("input_len_uniform"))
    outputs = _spread(int(_field(batch, "output_tokens")), count, workload.get("output_len_uniform"))
    return list(zip(inputs, reversed(outputs)))


def _spread(total: int, count: int, bounds: Any) -> list[int]:
    if count < 1 or total < count:
        raise CalibrationError(f"batch scenario: {total} tokens over {count} prompts")
    low, high = bounds if isinstance(bounds, list) and len(bounds) == 2 else (1, 1)
    raw = [low + (high - low) * (i + 0.5) / count for i in range(count)]
    scale = total / sum(raw)
    values = [max(1, round(v * scale)) for v in raw]
    values[-1] = max(1, values[-1] + total - sum(values))
    return values


def _field(mapping: Any, *path: str) -> Any:
    value = mapping
    for name in path:
        if not isinstance(value, Mapping) or name not in value:
            raise CalibrationError(f"benchmark JSON has no field {'.'.join(path)}")
        value = value[name]
    return value

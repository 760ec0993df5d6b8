"""Shared helpers for the benchmark runners.

Each runner is started by ``benchmarks/offline_throughput.py`` as a subprocess in
its engine's own virtual environment, so this module must only use the standard
library. A runner reads the workload JSON written by the driver, runs the
scenarios it is asked for, and writes one result JSON.

Workload format (written by the driver)::

    {"model_dir": str, "threads": int, "seed": int,
     "warmup": {"prompts": [[int]], "output_lens": [int]},
     "scenarios": {"batch": {...}, "decode": {...}, "prefill": {...}},
     "engine_options": {"<engine>": {...}}}

Every scenario has ``prompts`` (token-id lists) and ``output_lens`` (tokens to
generate per prompt, EOS ignored, greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCENARIOS = ("batch", "decode", "prefill")
COMPARE_TOKENS = 16  # leading generated tokens recorded for cross-engine agreement


@dataclass
class Scenario:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Workload:
    model_dir: str
    threads: int
    seed: int
    warmup: Scenario
    scenarios: dict[str, Scenario]
    engine_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    repeats: int = 1

    def options(self, engine: str) -> dict[str, Any]:
        return self.engine_options.get(engine, {})


def _scenario(name: str, raw: dict[str, Any]) -> Scenario:
    return Scenario(name, [list(map(int, p)) for p in raw["prompts"]], list(map(int, raw["output_lens"])))


def load_workload(path: str | Path) -> Workload:
    raw = json.loads(Path(path).read_text())
    return Workload(
        model_dir=raw["model_dir"],
        threads=int(raw["threads"]),
        seed=int(raw["seed"]),
        warmup=_scenario("warmup", raw["warmup"]),
        scenarios={k: _scenario(k, v) for k, v in raw["scenarios"].items()},
        engine_options=raw.get("engine_options", {}),
        repeats=int(raw.get("repeats", 1)),
    )


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", required=True, help="workload JSON written by the driver")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset to run")
    parser.add_argument("--engine", default=None, help="engine label: selects engine_options and names the result")
    return parser.parse_args()


def set_thread_env(threads: int) -> None:
    """Pin OpenMP/MKL thread pools before any numeric library is imported."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))


def now() -> float:
    return time.perf_counter()


def check_lengths(scenario: Scenario, outputs: list[list[int]]) -> None:
    """Every engine must generate exactly the requested number of tokens."""
    got = [len(o) for o in outputs]
    if got != scenario.output_lens:
        pairs = enumerate(zip(got, scenario.output_lens, strict=False))
        bad = [(i, g, w) for i, (g, w) in pairs if g != w][:5]
        raise RuntimeError(f"{scenario.name}: generated lengths differ from requested (idx, got, want): {bad}")


def throughput_result(scenario: Scenario, wall_s: float, outputs: list[list[int]], **extra: Any) -> dict[str, Any]:
    """Standard numbers for a scenario whose outputs were produced in ``wall_s`` seconds."""
    check_lengths(scenario, outputs)
    result: dict[str, Any] = {
        "num_prompts": len(scenario.prompts),
        "input_tokens": scenario.input_tokens,
        "output_tokens": scenario.output_tokens,
        "wall_s": round(wall_s, 4),
        "output_tok_s": round(scenario.output_tokens / wall_s, 2),
        "total_tok_s": round((scenario.input_tokens + scenario.output_tokens) / wall_s, 2),
        "first_tokens": [o[:COMPARE_TOKENS] for o in outputs[:4]],
    }
    if scenario.name == "prefill":
        result["prefill_tok_s"] = round(scenario.input_tokens / wall_s, 2)
    result.update(extra)
    return result


def decode_result(
    scenario: Scenario, ttft_s: float, total_s: float, outputs: list[list[int]], method: str
) -> dict[str, Any]:
    """Single-stream numbers: decode tok/s excludes the prefill (time to first token)."""
    result = throughput_result(scenario, total_s, outputs)
    n_out = scenario.output_tokens
    result.update(
        ttft_s=round(ttft_s, 4),
        decode_tok_s=round((n_out - 1) / (total_s - ttft_s), 2) if total_s > ttft_s else None,
        ttft_method=method,
    )
    return result


def run_scenarios(
    workload: Workload,
    wanted: str,
    run_one: Callable[[Scenario], dict[str, Any]],
) -> dict[str, Any]:
    """Run each requested scenario ``repeats`` times, keeping the fastest run; a failure is recorded, not fatal."""
    results: dict[str, Any] = {}
    for name in wanted.split(","):
        if name not in workload.scenarios:
            continue
        try:
            runs = [run_one(workload.scenarios[name]) for _ in range(workload.repeats)]
            results[name] = min(runs, key=lambda r: r["wall_s"])
            if len(runs) > 1:
                results[name]["wall_s_all_runs"] = [r["wall_s"] for r in runs]
        except Exception as exc:
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(
            f"[{name}] {json.dumps({k: v for k, v in results[name].items() if k != 'first_tokens'})}",
            file=sys.stderr,
        )
    return results


def write_result(path: str | Path, engine: str, info: dict[str, Any], scenarios: dict[str, Any]) -> None:
    payload = {"engine": engine, **info, "python": sys.version.split()[0], "scenarios": scenarios}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


def run_all_at_once(
    generate: Callable[[list[list[int]], list[int]], list[list[int]]], scenario: Scenario
) -> dict[str, Any]:
    """Time one scenario for an engine that takes all prompts in one call (kvyard, vLLM).

    Decode TTFT comes from a separate max_tokens=1 run of the same prompt."""
    if scenario.name == "decode":
        t0 = now()
        generate(scenario.prompts, [1])
        ttft = now() - t0
        t0 = now()
        outputs = generate(scenario.prompts, scenario.output_lens)
        return decode_result(scenario, ttft, now() - t0, outputs, "separate max_tokens=1 run")
    t0 = now()
    outputs = generate(scenario.prompts, scenario.output_lens)
    return throughput_result(scenario, now() - t0, outputs, batch_size=len(scenario.prompts))


Generate = Callable[[list[int]], tuple[list[int], float]]  # prompt -> (output token ids, seconds)


def compare_speculation(
    prompts: list[list[int]], plain: Generate, speculative: Generate, output_tokens: int
) -> dict[str, Any]:
    """Each prompt decoded plainly, with speculation and plainly again (a noisy machine); the outputs with and
    without speculation compared. Returns decode rates of both, their ratio and the per-prompt times."""
    plain(prompts[0])  # warm-up
    speculative(prompts[0])
    rows = []
    for prompt in prompts:
        reference, before = plain(prompt)
        guessed, seconds = speculative(prompt)
        _, after = plain(prompt)
        rows.append({"plain_s": (before + after) / 2, "lookup_s": seconds, "equal": guessed == reference})
    plain_s, lookup_s = sum(r["plain_s"] for r in rows), sum(r["lookup_s"] for r in rows)
    total = output_tokens * len(rows)
    return {
        "plain_tokens_per_s": total / plain_s,
        "lookup_tokens_per_s": total / lookup_s,
        "speedup": plain_s / lookup_s,
        "outputs_equal": all(r["equal"] for r in rows),
        "per_prompt": rows,
    }

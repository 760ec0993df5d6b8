"""Speculative decoding, verification efficiency: how much faster the engine decodes when a proposer's guesses
are right a fraction r of the time, for K proposed tokens per step.

kvyard's bench model has random weights, so no real proposer's acceptance says anything about a trained model.
This benchmark measures the engine apart from the proposer: an oracle proposer (kvyard.testing.oracle_proposer)
proposes the known greedy continuation with each token made wrong with probability 1 - r. Every run's output is
checked against the run without speculation (exact, token for token). Each configuration's decode rate is divided
by that of the run without speculation measured right before and after it (this machine is shared and noisy).

    .venv/bin/python benchmarks/spec_decode.py --out benchmarks/results/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench_args import parser_with_work_dir

from kvyard.bench import provenance
from kvyard.testing.create_model import cached_model

if TYPE_CHECKING:
    from kvyard import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = parser_with_work_dir(__doc__, "models, packages and logs")
    parser.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=[0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0],
        help="r: the fraction of the oracle's guesses that are right",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        nargs="+",
        default=[2, 4, 8],
        help="K: tokens proposed per step (at most, when adaptive)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="prompts decoded together")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="random tokens per prompt")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument(
        "--no-adaptive", action="store_true", help="propose K tokens every step, whatever the acceptance"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "spec_decode.json", help="JSON result file"
    )
    return parser.parse_args()


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(count)]


def timed_generate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    started = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    return [output.token_ids for output in outputs], time.perf_counter() - started


def main() -> int:
    args = parse_args()
    from kvyard import LLM, SamplingParams  # PyTorch (1 s): after --help has been answered
    from kvyard.engine.speculative.policy import SpeculativeConfig
    from kvyard.testing.oracle_proposer import OracleProposer

    run = provenance.of_run()
    model = str(cached_model(args.work_dir))
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    plain = LLM(model)
    results: list[dict[str, Any]] = []
    for batch_size in args.batch_sizes:
        batch = prompts(batch_size, args.prompt_tokens)
        reference, _ = timed_generate(plain, batch, params)  # warm-up, and the continuations the oracle knows
        continuations = {tuple(p): r for p, r in zip(batch, reference)}
        for k in args.num_speculative_tokens:
            speculative = LLM(model, speculative=SpeculativeConfig("ngram", k, adaptive=not args.no_adaptive))
            for acceptance in args.acceptance:
                plain.reset_prefix_cache()
                _, before = timed_generate(plain, batch, params)
                speculative.reset_prefix_cache()
                oracle = OracleProposer(continuations, error_rate=1.0 - acceptance)
                speculative.engine.proposer = oracle
                stats_before = speculative.engine.stats()
                outputs, seconds = timed_generate(speculative, batch, params)
                stats = speculative.engine.stats()
                plain.reset_prefix_cache()
                _, after = timed_generate(plain, batch, params)
                assert outputs == reference, f"output differs with K={k}, r={acceptance}"
                proposed = stats.spec_proposed_tokens - stats_before.spec_proposed_tokens
                accepted = stats.spec_accepted_tokens - stats_before.spec_accepted_tokens
                row = {
                    "batch_size": batch_size,
                    "num_speculative_tokens": k,
                    "acceptance_set": acceptance,
                    "acceptance_measured": accepted / max(1, proposed),
                    "exact": True,
                    "tokens_per_s": batch_size * args.output_tokens / seconds,
                    "plain_tokens_per_s": batch_size * args.output_tokens / ((before + after) / 2),
                    "speedup": ((before + after) / 2) / seconds,
                }
                print(json.dumps(row), flush=True)
                results.append(row)
            speculative.close()
    conditions = {
        "model": "kvyard bench preset (llama, 56M, random weights), fp32",
        "device": "cpu",
        "cpus": os.cpu_count(),
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "proposer": "oracle (known greedy continuation, each token wrong with probability 1 - r)",
        "adaptive_k": not args.no_adaptive,
        "prefix_cache": "reset before every run",
        "provenance": run,
    }
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Constrained decoding, throughput cost: batch decode with every request under a JSON schema against the same
batch unconstrained, in one run.

Each step computes one token mask per constrained request (llguidance) and applies it to the logits; the question
is what that costs next to the model's own step. Two schemas: `unbounded` cannot close before max_tokens (an
array of at least 500 integers), so every request decodes exactly `--output-tokens` tokens and the batch never
shrinks: the pure per-step cost; `person` is a realistic extraction schema whose requests end when the object
closes (their rate is generated tokens over wall time). Unconstrained runs (sampled, the same seeds) are measured
right before and after each constrained one, and the ratio is to their mean (this machine is shared and noisy).

    .venv/bin/python benchmarks/structured_output.py --out benchmarks/results/structured_output.json
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

from kvyard.testing.create_model import cached_model

if TYPE_CHECKING:  # imported where used: PyTorch (1 s) only after --help has been answered
    from kvyard import LLM, SamplingParams
    from kvyard.engine.sampling.structured_output import StructuredOutput

REPO = Path(__file__).resolve().parents[1]
SCHEMAS: dict[str, dict[str, Any]] = {
    "unbounded": {
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 500}},
        "required": ["values"],
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "maxLength": 40},
            "member": {"type": "boolean"},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        },
        "required": ["name", "age", "email", "member", "role", "tags"],
        "additionalProperties": False,
    },
}


def parse_args() -> argparse.Namespace:
    parser = parser_with_work_dir(__doc__, "models, packages and logs")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], help="prompts decoded together")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="random tokens per prompt")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="constrained and plain runs per configuration")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "structured_output.json", help="JSON result file"
    )
    return parser.parse_args()


def prompts(count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(count)]


def run(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> tuple[int, float, list[Any]]:
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(output.token_ids) for output in outputs), seconds, outputs


def params_for(count: int, max_tokens: int, structured: StructuredOutput | None) -> list[SamplingParams]:
    from kvyard import SamplingParams

    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=structured is None, structured=structured
        )
        for seed in range(count)
    ]


def main() -> int:
    args = parse_args()
    from kvyard import LLM
    from kvyard.engine.sampling.structured_output import StructuredOutput

    llm = LLM(str(cached_model(args.work_dir)))
    results: list[dict[str, Any]] = []
    for batch_size in args.batch_sizes:
        batch = prompts(batch_size, args.prompt_tokens)
        plain = params_for(batch_size, args.output_tokens, None)
        run(llm, batch, plain)  # warm-up
        for name, schema in SCHEMAS.items():
            constrained = params_for(batch_size, args.output_tokens, StructuredOutput.json_schema(schema))
            run(llm, batch, constrained)  # compiles and caches the grammar
            for repeat in range(args.repeats):
                plain_before = run(llm, batch, plain)
                tokens, seconds, outputs = run(llm, batch, constrained)
                plain_after = run(llm, batch, plain)
                plain_rate = (plain_before[0] + plain_after[0]) / (plain_before[1] + plain_after[1])
                valid = sum(1 for o in outputs if o.finish_reason == "stop" and _is_json(o.text))
                row = {
                    "batch_size": batch_size,
                    "schema": name,
                    "repeat": repeat,
                    "constrained_tokens_per_s": tokens / seconds,
                    "plain_tokens_per_s": plain_rate,
                    "ratio": tokens / seconds / plain_rate,
                    "mean_output_tokens": tokens / batch_size,
                    "ended_with_valid_json": valid,
                    "requests": batch_size,
                }
                print(json.dumps(row), flush=True)
                results.append(row)
    conditions = {
        "model": "kvyard bench preset (llama, 56M, random weights, vocab 32000), fp32",
        "device": "cpu",
        "cpus": os.cpu_count(),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.output_tokens,
        "sampling": "temperature 1.0, seeded; unconstrained runs ignore EOS",
        "speculative": "off",
        "grammar_engine": "llguidance",
        "prefix_cache": "reset before every run",
    }
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())

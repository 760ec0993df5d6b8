"""What a prefix-cache hit is worth to one idle vLLM-CPU replica: time to first token of a turn (a history plus
400 new tokens) with its history cached, against the same prompt computed whole.

    .venv/bin/python benchmarks/vllm_prefix_hit.py [--histories 1500 3000 6000] [--trials 6]
        [--out benchmarks/results/vllm_prefix_hit.json]

One vLLM server (.venv-vllm, the demo model in fp32, block size 32, bound to one core). For each history length
and trial: a fresh random history, the prefix cache emptied (/reset_prefix_cache), the history sent (one output
token: it is now cached), then the turn, timed to its first streamed token; the cache emptied again and the same
turn timed computed whole. The two are taken in turns, so a slow spell of a shared VM falls on both. Writes JSON
with the median of each and their ratio; conditions beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench import provenance
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.vllm_replicas import VLLM_BLOCK_SIZE, start_vllm, wait_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kvyard-demo"
NEW_TOKENS = 400


def first_token_s(url: str, prompt: list[int]) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


def reset(url: str) -> None:
    httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()


def measure(url: str, history_len: int, trials: int, rng: random.Random) -> dict[str, Any]:
    cached, computed = [], []
    for _ in range(trials):
        history = [rng.randrange(100, 5000) for _ in range(history_len)]
        turn = history + [rng.randrange(100, 5000) for _ in range(NEW_TOKENS)]
        reset(url)
        first_token_s(url, history)
        cached.append(first_token_s(url, turn))
        reset(url)
        computed.append(first_token_s(url, turn))
    hit, whole = statistics.median(cached), statistics.median(computed)
    return {
        "history_tokens": history_len,
        "new_tokens": NEW_TOKENS,
        "ttft_cached_s": hit,
        "ttft_computed_s": whole,
        "computed_over_cached": whole / hit,
        "cached_runs_s": cached,
        "computed_runs_s": computed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", type=int, nargs="+", default=[1500, 3000, 6000])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_prefix_hit.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="vllm-prefix-hit-"))
    replica = start_vllm(
        DEMO_MODEL_DIR, scratch, served_name=MODEL, cpus="1", events=False, environment={"VLLM_SERVER_DEV_MODE": "1"}
    )
    rows = []
    try:
        print("starting vLLM (about a minute) ...", file=sys.stderr, flush=True)
        wait_ready([replica], timeout=600)
        rng = random.Random(args.seed)
        for history_len in args.histories:
            row = measure(replica.url, history_len, args.trials, rng)
            print(
                f"history {history_len} + {NEW_TOKENS} new: cached {row['ttft_cached_s'] * 1000:.0f} ms, computed "
                f"{row['ttft_computed_s'] * 1000:.0f} ms ({row['computed_over_cached']:.1f}x)",
                file=sys.stderr,
            )
            rows.append(row)
    finally:
        replica.stop()
    engine = f"vllm-cpu 0.32.0, demo model (fp32), block size {VLLM_BLOCK_SIZE}, one core, one request at a time"
    conditions = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": provenance.host()["cpu"],
        "cores": os.cpu_count(),
        "engine": engine,
        "trials": args.trials,
        "seed": args.seed,
    }
    result = {"benchmark": "vllm_prefix_hit", "conditions": conditions, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

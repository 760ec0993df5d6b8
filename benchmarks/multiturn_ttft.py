"""TTFT of a growing multi-turn conversation with prefix caching on vs off, through `kvyard serve`.

One session of N turns on the `bench` preset: every turn resends the whole history (system
prompt, earlier user turns, the assistant's earlier answers) plus a new user message, as a chat
client does. The same session runs against a server with prefix caching and one without, one
server at a time; each turn's TTFT (first streamed token) is recorded and the ratio
cached / uncached is reported per turn, with the history length.

    .venv/bin/python benchmarks/multiturn_ttft.py --turns 10 --out benchmarks/results/multiturn_ttft.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_utils import ServerProcess, start_server  # noqa: E402

from kvyard.testing.create_model import ensure_default_model  # noqa: E402

WORDS = (
    "cache",
    "block",
    "token",
    "prefix",
    "replica",
    "router",
    "decode",
    "prefill",
    "latency",
    "batch",
    "memory",
    "tensor",
    "kernel",
    "stream",
    "request",
    "session",
    "history",
    "model",
    "serve",
    "queue",
)


def user_message(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def run_session(
    server: ServerProcess, turns: int, system_words: int, words_per_turn: int, max_tokens: int, seed: int
) -> list[dict]:
    rng = random.Random(seed)
    messages: list[dict[str, str]] = [{"role": "system", "content": user_message(rng, system_words)}]
    results = []
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": user_message(rng, words_per_turn)})
            body = {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.perf_counter()
            ttft, text, usage = None, "", None
            with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece and ttft is None:
                            ttft = time.perf_counter() - start
                        text += piece or ""
            assert usage is not None and ttft is not None
            messages.append({"role": "assistant", "content": text})
            results.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "ttft_s": ttft,
                    "e2e_s": time.perf_counter() - start,
                }
            )
            print(
                f"  turn {turn + 1}: {usage['prompt_tokens']} prompt tokens, "
                f"{usage['prompt_tokens_details']['cached_tokens']} cached, TTFT {ttft * 1000:.0f} ms"
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-words", type=int, default=200, help="words in the system prompt")
    parser.add_argument("--words-per-turn", type=int, default=300, help="words in each new user message")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model dir (default: the embedded bench model)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/multiturn_ttft.json")
    args = parser.parse_args()
    model = Path(args.model) if args.model else ensure_default_model()
    log_dir = Path("/tmp/kvyard-bench-logs")
    log_dir.mkdir(exist_ok=True)
    runs: dict[str, list[dict]] = {}
    # The persistent KV tier is off in both runs: this measures the device prefix cache alone
    # (benchmarks/kv_tier.py measures the tier).
    for label, flags in (("prefix_cache_on", ()), ("prefix_cache_off", ("--no-prefix-caching",))):
        print(f"{label}:")
        server = start_server(model, log_dir, "--max-model-len", "8192", "--kv-tier", "none", *flags, timeout=300)
        try:
            runs[label] = run_session(
                server, args.turns, args.system_words, args.words_per_turn, args.max_tokens, args.seed
            )
        finally:
            server.stop()
    per_turn = [
        {**on, "ttft_off_s": off["ttft_s"], "ttft_ratio_on_off": on["ttft_s"] / off["ttft_s"]}
        for on, off in zip(runs["prefix_cache_on"], runs["prefix_cache_off"])
    ]
    report = {
        "benchmark": "multiturn_ttft",
        "conditions": {
            "model": str(model),
            "model_config": json.loads((model / "config.json").read_text()),
            "dtype": "float32",
            "device": "cpu",
            "cpu": _cpu_name(),
            "cores": _cores(),
            "speculative_decoding": False,
            "kv_tier": "none",
            "concurrency": 1,
            "turns": args.turns,
            "words_per_user_turn": args.words_per_turn,
            "system_prompt_words": args.system_words,
            "max_tokens_per_turn": args.max_tokens,
            "seed": args.seed,
            "kvyard_commit": _commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
        "turns": per_turn,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT on':>9} {'TTFT off':>9} {'ratio':>6}")
    for row in per_turn:
        print(
            f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} {row['ttft_s'] * 1000:>7.0f}ms "
            f"{row['ttft_off_s'] * 1000:>7.0f}ms {row['ttft_ratio_on_off']:>6.3f}"
        )
    print(f"wrote {args.out}")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _cores() -> int:
    import os

    return os.cpu_count() or 0


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return result.stdout.strip()


if __name__ == "__main__":
    main()

"""TTFT of a long prompt served from each KV tier (memory, disk, Redis) vs recomputed, and each tier's load bandwidth.

Offline engine (`LLM`) on the `bench` preset, fp32, CPU. For every tier the prompt is run once to
fill the tier (and the write queue flushed), then the device prefix cache is cleared and the same
prompt is timed with `max_tokens=1` (so the time is the TTFT): every full block but the last
prompt token's comes from that tier alone. Recompute is the same prompt with no tier. Each
measurement is repeated and the median kept. The disk tier is read through the OS page cache
unless the script can drop it (root with a writable /proc/sys/vm/drop_caches); the JSON says
which. Redis is a local redis-server on loopback started by the script.

    .venv/bin/python benchmarks/kv_tier.py --out benchmarks/results/kv_tier.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvyard import SamplingParams  # the engine's LLM imports torch (1 s); SamplingParams alone does not
from kvyard.testing.create_model import ensure_default_model

if TYPE_CHECKING:
    from kvyard import LLM
    from kvyard.kvcache import KVTierConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # for redis_utils, imported where used (it takes 0.5 s)

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def cpu_busy_fraction(window_s: float = 2.0) -> float:
    def sample() -> tuple[int, int]:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = values[3] + values[4]
        return sum(values) - idle, sum(values)

    busy0, total0 = sample()
    time.sleep(window_s)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def timed_generate(llm: LLM, prompt: list[int]) -> tuple[float, int, list[int]]:
    start = time.perf_counter()
    output = llm.generate([prompt], ONE_TOKEN)[0]
    return time.perf_counter() - start, output.num_cached_tokens, output.token_ids


def measure_recompute(model: Path, prompt: list[int], repeats: int, engine: dict[str, Any]) -> dict[str, Any]:
    from kvyard import LLM  # imports torch (1 s): not before --help has had its chance

    with LLM(str(model), **engine) as llm:
        llm.generate([prompt[:256]], ONE_TOKEN)  # warm-up
        runs = []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            runs.append(timed_generate(llm, prompt))
    return {
        "ttft_s": statistics.median(r[0] for r in runs),
        "runs_s": [r[0] for r in runs],
        "cached_tokens": runs[0][1],
        "token": runs[0][2],
    }


def measure_tier(
    model: Path, prompt: list[int], repeats: int, engine: dict[str, Any], tier: KVTierConfig, cold_disk: bool
) -> dict[str, Any]:
    from kvyard import LLM

    with LLM(str(model), kv_tier=tier, **engine) as llm:
        llm.generate([prompt[:256]], ONE_TOKEN)  # warm-up
        llm.generate([prompt], ONE_TOKEN)  # fills the tier
        link = llm.engine.kv_tier
        assert link is not None and link.store.flush(600)
        before = link.store.snapshot().tiers[tier.tiers[0]]
        runs, dropped = [], []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            if cold_disk:
                dropped.append(drop_page_cache())
            runs.append(timed_generate(llm, prompt))
        after = link.store.snapshot().tiers[tier.tiers[0]]
    read_bytes = after.bytes_read - before.bytes_read
    read_s = after.load_seconds - before.load_seconds
    ttft = statistics.median(r[0] for r in runs)
    return {
        "ttft_s": ttft,
        "runs_s": [r[0] for r in runs],
        "cached_tokens": runs[0][1],
        "token": runs[0][2],
        "blocks_per_run": (after.hits - before.hits) // repeats,
        "bytes_per_run": read_bytes // repeats,
        "tier_read_bandwidth_gb_s": read_bytes / read_s / 1e9 if read_s else None,
        "end_to_end_load_bandwidth_gb_s": read_bytes / repeats / ttft / 1e9,
        "page_cache_dropped": all(dropped) if cold_disk else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="tokens of the stored prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed reads per tier (median reported)")
    parser.add_argument("--model", default=None, help="model dir (None: the embedded bench model)")
    parser.add_argument("--tiers", default="memory,disk,redis", help="comma-separated tiers to measure")
    parser.add_argument("--cold-disk", action="store_true", help="drop the page cache before each disk read")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kv_tier.json", help="JSON result file")
    args = parser.parse_args()
    from redis_utils import start_redis

    from kvyard.kvcache import KVTierConfig

    model = Path(args.model) if args.model else ensure_default_model()
    prompt = [random.Random(0).randrange(3, 30000) for _ in range(args.prompt_tokens)]
    engine = {"max_model_len": args.prompt_tokens + 64}
    busy_before = cpu_busy_fraction()
    results: dict[str, Any] = {"recompute": measure_recompute(model, prompt, args.repeats, engine)}
    print(f"recompute: TTFT {results['recompute']['ttft_s'] * 1000:.0f} ms")
    with tempfile.TemporaryDirectory(prefix="kvyard-kv-bench-") as scratch:
        redis = start_redis(Path(scratch)) if "redis" in args.tiers else None
        try:
            for name in args.tiers.split(","):
                tier = KVTierConfig(tiers=(name,), disk_dir=f"{scratch}/disk", redis_url=redis and redis.url)
                result = measure_tier(model, prompt, args.repeats, engine, tier, args.cold_disk and name == "disk")
                result["ttft_ratio_vs_recompute"] = result["ttft_s"] / results["recompute"]["ttft_s"]
                result["same_first_token"] = result["token"] == results["recompute"]["token"]
                results[name] = result
                print(
                    f"{name}: TTFT {result['ttft_s'] * 1000:.0f} ms ({result['ttft_ratio_vs_recompute']:.3f}x), "
                    f"{result['cached_tokens']} cached tokens, tier read {result['tier_read_bandwidth_gb_s']:.2f} "
                    f"GB/s, end to end {result['end_to_end_load_bandwidth_gb_s']:.2f} GB/s"
                )
        finally:
            if redis is not None:
                redis.kill()
    report = {
        "benchmark": "kv_tier",
        "conditions": {
            "model": str(model),
            "model_config": json.loads((model / "config.json").read_text()),
            "dtype": "float32",
            "device": "cpu",
            "prompt_tokens": args.prompt_tokens,
            "block_size": 16,
            "repeats": args.repeats,
            "statistic": "median",
            "cpu_busy_before": round(busy_before, 3),
            "cores": __import__("os").cpu_count(),
            "redis": "local redis-server on loopback",
            "kvyard_commit": subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
            ).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

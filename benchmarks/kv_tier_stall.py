"""Inter-token latency of running streams while a request loads its prefix from a stalled Redis.

Offline engine (`LLM`, stepped by hand) on the embedded default model, fp32, CPU, Redis tier only, on a
local redis-server started by the script. A writer stores two long prompts' blocks in Redis. The reader
starts `--streams` greedy decodes, then runs two phases of `--phase-s` seconds each:

- baseline: one request whose prompt is in Redis arrives; Redis answers normally;
- stall: Redis is stalled (`DEBUG SLEEP --phase-s`) and a request for the other stored prompt arrives.

Both phases run twice: with kvyard's loads off the engine thread, and with the engine waiting for each
load inside its step (`kv_cache_manager.LOAD_WAIT_IN_STEP_S` raised past any deadline), which is how
kvyard loaded blocks before and what a synchronous connector does.

Inter-token latency (ITL) is the time between consecutive tokens of one running stream; the JSON holds
each phase's p50/p99 and their ratio, the loading request's wait and its cached tokens.

    .venv/bin/python benchmarks/kv_tier_stall.py --out benchmarks/results/kv_tier_stall.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvyard import SamplingParams  # the engine's LLM imports torch (1 s); SamplingParams alone does not
from kvyard.testing.create_model import ensure_default_model

if TYPE_CHECKING:
    from redis_utils import RedisProcess

    from kvyard.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # for redis_utils, imported where used (it takes 0.5 s)

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
DECODE = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 1000) for _ in range(length)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_phase(
    engine: LLMEngine, streams: list[str], loader: str, loaded_prompt: list[int], seconds: float
) -> dict[str, Any]:
    """Step for `seconds` after `loader` arrives; the ITLs of `streams` and how long `loader` waited."""
    last = dict.fromkeys(streams, time.perf_counter())
    gaps: list[float] = []
    arrived = time.perf_counter()
    engine.add_request(loader, loaded_prompt, ONE_TOKEN)
    loader_done: dict[str, Any] = {}
    while time.perf_counter() - arrived < seconds or loader not in loader_done:
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id in last:
                gaps.append(now - last[output.request_id])
                last[output.request_id] = now
            elif output.request_id == loader and output.finished:
                loader_done[loader] = {"wait_s": now - arrived, "cached_tokens": output.num_cached_tokens}
        if time.perf_counter() - arrived > 10 * seconds:
            raise RuntimeError(f"{loader} did not finish")
    return {
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
        "itl_max_ms": 1e3 * max(gaps),
        "tokens": len(gaps),
        "loader": loader_done[loader],
    }


def stall(redis: RedisProcess, seconds: float) -> threading.Thread:
    client = redis.client()
    thread = threading.Thread(target=lambda: client.execute_command("DEBUG", "SLEEP", str(seconds)), daemon=True)
    thread.start()
    time.sleep(0.05)  # the server is asleep before the request arrives
    return thread


def measure(model: Path, redis: RedisProcess, stored: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from kvyard import LLM  # imports torch (1 s): not before --help has had its chance
    from kvyard.kvcache import KVTierConfig

    tier = KVTierConfig(
        tiers=("redis",), redis_url=redis.url, redis_timeout_s=3 * args.phase_s, load_deadline_s=3 * args.phase_s
    )
    redis.client().flushall()
    with LLM(str(model), kv_tier=tier) as writer:
        writer.generate(stored, ONE_TOKEN)
    with LLM(str(model), kv_tier=tier) as reader:
        engine = reader.engine
        streams = [f"stream-{i}" for i in range(args.streams)]
        for index, name in enumerate(streams):
            engine.add_request(name, prompt(100 + index, 64), DECODE)
        for _ in range(20):  # prefilled and decoding
            engine.step()
        baseline = run_phase(engine, streams, "load-baseline", stored[0], args.phase_s)
        sleeper = stall(redis, args.phase_s)
        stalled = run_phase(engine, streams, "load-stalled", stored[1], args.phase_s)
        sleeper.join()
    return {
        "baseline": baseline,
        "stall": stalled,
        "itl_p99_ratio_stall_over_baseline": stalled["itl_p99_ms"] / baseline["itl_p99_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=4, help="running greedy decodes")
    parser.add_argument("--phase-s", type=float, default=5.0, help="seconds of each phase and of the stall")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens of each stored prompt")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/kv_tier_stall.json", help="JSON result file"
    )
    args = parser.parse_args()
    from redis_utils import start_redis

    from kvyard.engine import kv_cache_manager

    model = ensure_default_model()
    stored = [prompt(1, args.prompt_len), prompt(2, args.prompt_len)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        redis = start_redis(Path(scratch), extra=("--enable-debug-command", "yes"))
        try:
            for mode, wait_s in (("async_loads", kv_cache_manager.LOAD_WAIT_IN_STEP_S), ("loads_in_step", 1e9)):
                print(f"{mode}: baseline and stall phases, {args.phase_s:g} s each...", flush=True)
                kv_cache_manager.LOAD_WAIT_IN_STEP_S = wait_s
                results[mode] = measure(model, redis, stored, args)
        finally:
            redis.kill()
    result = {
        "conditions": {
            "model": "embedded default (kvyard.testing)",
            "dtype": "float32",
            "device": "cpu (2 cores)",
            "engine": "offline LLMEngine stepped by hand",
            "tiers": ["redis"],
            "streams": args.streams,
            "phase_s": args.phase_s,
            "stored_prompt_tokens": args.prompt_len,
            "stall": "redis DEBUG SLEEP for the stall phase",
        },
        **results,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

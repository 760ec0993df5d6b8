"""PD fleet benchmark: prefill/decode disaggregation against unified replicas, Mooncake trace, simulated fleet.

Every configuration has the same `--replicas` (8) simulated replicas (one `kvyard sim` process, per-replica prefix
cache smaller than the working set) behind kvyard's router: all unified with `--policy cache_aware`, and each split
of P prefill plus 8-P decode replicas (`--splits`) under `--disaggregation conditional` and `always`. Replicas
step with 2,048 tokens (`--max-num-batched-tokens`), and with 8,192 while none of their requests streams
(`--prefill-only-step-tokens`: a prefill replica's steps, unless it runs a request whole); unified fleets also run
with 8,192-token steps and with 2,048 / 8,192 as the PD replicas (`--unified-step-tokens`), so the best unified fleet
is the baseline, whichever budget that is. `--prefill-order` (fcfs or shortest) is every replica's order of
prompts, split and unified alike. Each run
replays the first `--requests` requests of the Mooncake conversation trace at their (sped-up) arrival times as
streaming completions, prompts and users built as in routing.py (one byte per token, equal hash ids give equal
prefixes, `user = conv-<second hash id>`), each asking for its trace output length (capped by `--max-output`) with
`ignore_eos`. The same arrivals go to every configuration, at each offered load of `--loads` (the fleet's
estimated busy fraction; the arrival speed-up follows from it).

The cost model (`--cost-preset`) decides what disaggregation can gain. `h100-llama3-8b` (default) is a roofline
estimate of Llama-3-8B bf16 on H100s with 200 Gb/s RDMA between replicas (kvyard/sim/roofline.py): prefill bound by
compute, decode by memory bandwidth, as on the GPUs PD is built for; its figures come from public specifications,
not from a measurement. `cpu` is the model measured on this machine's CPU, where decode is cheap beside prefill
(about 1 % of this trace's work).

Per request the client records TTFT (time to the first streamed token) and TPOT ((last token - first token) /
(output tokens - 1)), in **simulated seconds** (wall seconds / time scale). A request meets the SLO when TTFT <=
max(`--ttft-slo-min-s`, `--ttft-slo-factor` x its prompt's prefill time alone on an idle replica of the cost model)
and TPOT <= `--tpot-slo-s` (a request of one token has no TPOT to miss); the bounds are fixed before any run. SLO
attainment is the fraction of requests that meet it. **Goodput**, DistServe's way, is the highest arrival rate at
which attainment stays >= `--attainment` (90 %), interpolated between the loads run; the rate of requests meeting
the SLO at each load is reported too. Transfer bytes per request are the decode sims' modeled KV bytes
(`kvyard_sim_transfer_model_bytes_total`) over the completed requests; blocks stream while the prefill runs, and
a pull is held back after its last block for what the modeled link would still need (latency plus the last
chunk's bytes over bandwidth, or more when the link could not keep up: `SimConfig.streamed_transfer_seconds`).
A run that has not finished `--drain-s` wall seconds after its last arrival is cut: its unfinished requests count
as failed. The sims keep their cost model's schedule through stalls of their shared event loop shorter than
`kvyard sim --catch-up-s` (0.05 wall seconds); `sim_lag_wall_s` is how far each fell behind beyond that.

    .venv/bin/python benchmarks/pd_fleet.py                 # full size: benchmarks/results/pd_fleet.{json,png}
    .venv/bin/python benchmarks/pd_fleet.py --smoke         # about 3 minutes: benchmarks/results/pd_fleet_smoke.*
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from routing import (
    MODEL,
    TRACE,
    TRACE_BLOCK,
    TraceRequest,
    free_port,
    ideal_hit_ratio,
    launch_sims,
    load_trace,
    percentile,
    prompt_text,
    service_seconds,
)

from kvyard.api.metrics import MODEL_NAME
from kvyard.bench import provenance
from kvyard.engine.scheduling.scheduler import PREFILL_ORDERS
from kvyard.router.config import RouterConfig
from kvyard.sim.config import SimConfig
from kvyard.sim.cost_model import CostModel, StepShape, prefill_pairs
from kvyard.sim.roofline import ROOFLINE_PRESETS, roofline_preset

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ADMIN_KEY = "pd-fleet-benchmark-admin"  # the sims' admin plane (KV events, transfers) and the router's
# Longer than any prefill of the default slice alone (its longest prompt, 120k tokens, takes about 1,100 simulated
# seconds), so a pull ends when its prefill ends unless queueing adds most of an hour.
PULL_DEADLINE_S = 3600.0
SMOKE = {"requests": 60, "drain_s": 20.0, "loads": "0.6,1.2", "splits": "4"}
CAPACITY_TOKENS = 32768 * 16  # per replica, as routing.py's run of record
# A replica's step budget while nothing streams, as on a prefill replica: vLLM's default for online serving on GPUs
# of 70 GB and more. While a request streams replicas keep the engine's 2,048 (a step that long stalls decodes).
PREFILL_STEP_TOKENS = 8192
CPU_PRESET = "cpu"  # the sim's default cost model, measured on this machine
Sample = tuple[float | None, float | None]  # one request's (TTFT, TPOT), simulated seconds; TTFT None: it failed


@dataclass(frozen=True, slots=True)
class Fleet:
    name: str
    prefill_replicas: int  # 0: every replica unified
    disaggregation: str | None = None
    step_tokens: int = 0  # unified fleets: every replica's step budget (0: --max-num-batched-tokens)
    prefill_only_tokens: int | None = None  # its budget while nothing streams (None: --prefill-only-step-tokens)


@dataclass(slots=True)
class Result:
    ok: bool = False
    status: int = 0
    ttft_s: float = 0.0  # wall
    last_token_s: float = 0.0  # wall, from the request's start
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.output_tokens - 1)


def unified_fleet(replicas: int, budgets: str) -> Fleet:
    """`8192`: every step up to 8,192 tokens; `2048/8192`: 2,048 while a request streams, else 8,192."""
    streaming, _, alone = budgets.partition("/")
    if alone:
        return Fleet(
            f"unified cache_aware ({replicas}), {alone}-token steps when nothing streams",
            0,
            None,
            int(streaming),
            int(alone),
        )
    return Fleet(f"unified cache_aware ({replicas}), {streaming}-token steps", 0, None, int(streaming), 0)


def fleets(replicas: int, splits: list[int], modes: list[str], unified_step_tokens: list[str]) -> list[Fleet]:
    runs = [Fleet(f"unified cache_aware ({replicas})", 0, prefill_only_tokens=0)]
    runs += [unified_fleet(replicas, budgets) for budgets in unified_step_tokens]
    runs += [Fleet(f"{p}P+{replicas - p}D {mode}", p, mode) for p in splits for mode in modes]
    return runs


# ---------------------------------------------------------------------------- processes


def start_sims(args: argparse.Namespace, fleet: Fleet, log: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    ports_file = log.with_suffix(".ports.json")
    ports_file.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "sim",
        "--replicas",
        str(args.replicas),
        "--prefill-replicas",
        str(fleet.prefill_replicas),
        "--port",
        "0",
        "--ports-file",
        str(ports_file),
        "--num-kv-blocks",
        str(args.capacity_blocks),
        "--block-size",
        str(args.block_size),
        "--time-scale",
        str(args.time_scale),
        "--stream-interval-s",
        str(args.stream_interval_s),
        "--transfer-latency-s",
        str(args.transfer_latency_s),
        "--kv-transfer-timeout-s",
        str(args.kv_transfer_timeout_s),
        "--admin-key",
        ADMIN_KEY,
        "--max-num-batched-tokens",
        str(fleet.step_tokens or args.max_num_batched_tokens),
        "--prefill-only-step-tokens",
        str(args.prefill_only_step_tokens if fleet.prefill_only_tokens is None else fleet.prefill_only_tokens),
        "--prefill-order",
        args.prefill_order,
    ]
    if args.cost_preset != CPU_PRESET:
        command += ["--cost-preset", args.cost_preset]
    if args.kv_bytes_per_token is not None:
        command += ["--kv-bytes-per-token", str(args.kv_bytes_per_token)]
    if args.transfer_gb_per_s is not None:
        command += ["--transfer-gb-per-s", str(args.transfer_gb_per_s)]
    if args.shared_store_blocks:
        command += [
            "--shared-store-blocks",
            str(args.shared_store_blocks),
            "--shared-store-gb-per-s",
            str(args.shared_store_gb_per_s),
        ]
    return launch_sims(command, ports_file, log)


def transfer_gb_per_s(args: argparse.Namespace) -> float:
    """The link between replicas: PD pulls and, by default, the shared store use it."""
    if args.transfer_gb_per_s is not None:
        return float(args.transfer_gb_per_s)
    return (
        SimConfig().transfer_gb_per_s
        if args.cost_preset == CPU_PRESET
        else roofline_preset(args.cost_preset).transfer_gb_per_s
    )


def start_router(
    args: argparse.Namespace, fleet: Fleet, workers: list[str], log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "route",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--admin-key",
        ADMIN_KEY,
        "--replica-admin-key",
        ADMIN_KEY,
    ]
    if fleet.disaggregation is not None:
        command += [
            "--disaggregation",
            fleet.disaggregation,
            "--pd-local-prefill-tokens",
            str(args.pd_local_prefill_tokens),
        ]
        if args.pd_decode_prefill_budget is not None:
            command += ["--pd-decode-prefill-budget", str(args.pd_decode_prefill_budget)]
    if args.router_log_level is not None:
        command += ["--log-level", args.router_log_level]
    for url in workers:
        command += ["--replica", url]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


async def wait_fleet(url: str, count: int, timeout: float) -> None:
    """Until the router lists `count` healthy replicas, each with its cache index synced from its KV snapshot (the
    snapshot also gives the block namespace that PD pairing checks)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(f"{url}/admin/replicas", headers=headers) as response:
                    listed = (await response.json())["replicas"] if response.status == 200 else []
                if len(listed) == count and all(r["state"] == "healthy" and r["resyncs"] for r in listed):
                    return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"router at {url} not ready after {timeout}s")


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---------------------------------------------------------------------------- load


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, user: str) -> Result:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "user": user,
    }
    started = time.perf_counter()
    result = Result()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            result.status = response.status
            if response.status != 200:
                await response.read()
                return result
            async for line in response.content:
                if line.startswith(b"data: {"):
                    _read_chunk(json.loads(line[6:]), time.perf_counter() - started, result)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return result
    result.ok = result.output_tokens > 0 and result.ttft_s > 0
    return result


def _read_chunk(chunk: dict[str, Any], elapsed: float, result: Result) -> None:
    if chunk.get("choices"):
        result.ttft_s = result.ttft_s or elapsed
        result.last_token_s = elapsed
    usage = chunk.get("usage")
    if usage:
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def replay(
    url: str, requests: list[TraceRequest], prompts: list[str], speedup: float, drain_s: float
) -> tuple[list[Result], float]:
    """Every request at its arrival time; what is unfinished `drain_s` after the last arrival is cut (failed)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()

        async def at_arrival(index: int) -> Result:
            request = requests[index]
            await asyncio.sleep(max(0.0, start + request.arrival_s / speedup - time.perf_counter()))
            user = f"conv-{request.hash_ids[1] if len(request.hash_ids) > 1 else index}"
            return await one_request(session, url, prompts[index], request.output_length, user)

        tasks = [asyncio.ensure_future(at_arrival(i)) for i in range(len(requests))]
        last_arrival = max(r.arrival_s for r in requests) / speedup
        await asyncio.wait(tasks, timeout=last_arrival + drain_s)
        elapsed = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return [t.result() if not t.cancelled() else Result() for t in tasks], elapsed


# ---------------------------------------------------------------------------- metrics


async def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, by its name with its labels but the model's (summed over models)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items() if key != MODEL_NAME)
            name = f"{sample.name}{{{labels}}}" if labels else sample.name
            samples[name] = samples.get(name, 0.0) + sample.value
    return samples


def labelled(samples: dict[str, float], prefix: str) -> dict[str, float]:
    """`{label value: sample}` of a metric with one label."""
    return {name.split('"')[1]: value for name, value in samples.items() if name.startswith(prefix + "{")}


def rounded(values: dict[str, float]) -> dict[str, float]:
    return {key: round(value, 3) for key, value in values.items()}


async def fleet_metrics(router: str, workers: list[str], fleet: Fleet) -> dict[str, Any]:
    sims = [await scrape(url) for url in workers]
    prefillers, decoders = sims[: fleet.prefill_replicas], sims[fleet.prefill_replicas :]
    routed = await scrape(router)
    fallbacks: dict[str, float] = {}
    for sim in decoders:
        for reason, count in labelled(sim, "kvyard_kv_transfer_fallbacks_total").items():
            fallbacks[reason] = fallbacks.get(reason, 0) + count
    return {
        "pd_paths": labelled(routed, "kvyard_router_pd_requests_total"),
        "prefill_legs": labelled(routed, "kvyard_router_pd_prefill_legs_total"),
        "pulls": sum(s.get("kvyard_kv_transfer_pulls_total", 0) for s in decoders),
        "pulled_blocks": sum(s.get("kvyard_kv_transfer_pulled_blocks_total", 0) for s in decoders),
        "pulled_wire_bytes": sum(s.get("kvyard_kv_transfer_pulled_bytes_total", 0) for s in decoders),
        "modeled_transfer_bytes": sum(s.get("kvyard_sim_transfer_model_bytes_total", 0) for s in decoders),
        "modeled_transfer_s": sum(s.get("kvyard_sim_transfer_model_seconds_total", 0) for s in decoders),
        "pull_fallbacks": fallbacks,
        "leased_blocks_at_end": sum(s.get("kvyard_kv_transfer_leased_blocks", 0) for s in prefillers),
        "requests_per_replica": [int(sum(labelled(s, "kvyard_requests_total").values())) for s in sims],
        "sim_lag_wall_s": [round(s.get("kvyard_sim_lag_seconds", 0), 3) for s in sims],
        "preemptions_per_replica": [int(s.get("kvyard_num_preemptions_total", 0)) for s in sims],
        # Per replica, by the tier that served them (host, shared): tokens loaded and simulated seconds charged.
        "tier_hit_tokens": [labelled(s, "kvyard_sim_tier_hit_tokens_total") for s in sims],
        "tier_model_s": [rounded(labelled(s, "kvyard_sim_tier_model_seconds_total")) for s in sims],
    }


def summarize(fleet: Fleet, results: list[Result], elapsed_wall: float, time_scale: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s / time_scale for r in done]
    tpots = [t / time_scale for r in done if (t := r.tpot_s) is not None]
    elapsed = elapsed_wall / time_scale
    return {
        "fleet": fleet.name,
        "prefill_replicas": fleet.prefill_replicas,
        "disaggregation": fleet.disaggregation,
        "completed": len(done),
        "failed": len(results) - len(done),
        "failed_statuses": sorted({r.status for r in results if not r.ok}),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tpot_p50_s": percentile(tpots, 0.5),
        "tpot_p90_s": percentile(tpots, 0.9),
        "tpot_p99_s": percentile(tpots, 0.99),
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": sum(r.output_tokens for r in done) / elapsed,
        "hit_ratio": sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_tokens for r in done)),
        "elapsed_s": elapsed,
        "elapsed_wall_s": elapsed_wall,
    }


def sample(result: Result, time_scale: float) -> Sample:
    if not result.ok:
        return None, None
    tpot = result.tpot_s
    return round(result.ttft_s / time_scale, 4), None if tpot is None else round(tpot / time_scale, 5)


def meets(row: Sample, ttft_bound: float, tpot_bound: float) -> bool:
    """Finished within both bounds (a request of one token has no TPOT to miss)."""
    ttft, tpot = row
    return ttft is not None and ttft <= ttft_bound and (tpot is None or tpot <= tpot_bound)


def alone_prefill_seconds(cost: CostModel, prompt_tokens: int, budget: int) -> float:
    """A prompt's prefill on an idle replica, chunk by chunk as the scheduler's token budget cuts it."""
    seconds, done = 0.0, 0
    while done < prompt_tokens:
        chunk = min(budget, prompt_tokens - done)
        seconds += cost.step_seconds(StepShape(prefill_tokens=chunk, prefill_pairs=prefill_pairs(chunk, done)))
        done += chunk
    return seconds


def ttft_bounds(args: argparse.Namespace, requests: list[TraceRequest]) -> list[float]:
    cost, budget = cost_model(args), SimConfig().scheduler.max_num_batched_tokens
    return [
        max(args.ttft_slo_min_s, args.ttft_slo_factor * alone_prefill_seconds(cost, r.input_length, budget))
        for r in requests
    ]


def with_attainment(
    run: dict[str, Any], rows: list[Sample], ttft_bounds: list[float], tpot_bound: float
) -> dict[str, Any]:
    good = sum(meets(row, bound, tpot_bound) for row, bound in zip(rows, ttft_bounds, strict=True))
    return {**run, "slo_attainment": good / max(1, len(rows)), "slo_met_per_s": good / run["elapsed_s"]}


def goodput(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """DistServe's goodput: the highest offered rate whose SLO attainment is >= `target`, linear between the loads
    run (attainment 1 at rate 0). `bound` says when it lies outside them."""
    points = [(0.0, 1.0), *sorted((r["offered_requests_per_s"], r["slo_attainment"]) for r in runs)]
    for (rate, attained), (next_rate, next_attained) in itertools.pairwise(points):
        if next_attained < target <= attained:
            rate += (attained - target) / (attained - next_attained) * (next_rate - rate)
            return {"requests_per_s": rate, "bound": "interpolated" if rate > points[1][0] else "below the loads run"}
    return {"requests_per_s": points[-1][0], "bound": "at least (every load met the target)"}


def run_fleet(
    fleet: Fleet, args: argparse.Namespace, requests: list[TraceRequest], prompts: list[str], speedup: float, logs: Path
) -> tuple[dict[str, Any], list[Sample]]:
    slug = fleet.name.split(" (")[0].replace(" ", "_").replace("+", "_")
    sims, workers = start_sims(args, fleet, logs / f"sim-{slug}.log")
    router, url = start_router(args, fleet, workers, logs / f"router-{slug}.log")
    try:
        asyncio.run(wait_fleet(url, len(workers), 90))
        results, elapsed = asyncio.run(replay(url, requests, prompts, speedup, args.drain_s))
        summary = summarize(fleet, results, elapsed, args.time_scale)
        summary.update(asyncio.run(fleet_metrics(url, workers, fleet)))
        summary["transfer_bytes_per_request"] = summary["modeled_transfer_bytes"] / max(1, summary["completed"])
        return summary, [sample(r, args.time_scale) for r in results]
    finally:
        stop([router, sims])


# ---------------------------------------------------------------------------- report


def table_row(run: dict[str, Any]) -> str:
    return (
        f"{run['fleet']:<24} load {run['offered_load']:.2f} ({run['offered_requests_per_s']:.2f} req/s)  "
        f"TTFT p50 {run['ttft_p50_s']:6.2f} p99 {run['ttft_p99_s']:6.2f}  TPOT p50 {run['tpot_p50_s']:.4f} "
        f"p99 {run['tpot_p99_s']:.4f}  SLO met {run['slo_attainment']:.0%}  "
        f"{run['transfer_bytes_per_request'] / 1e6:.0f} MB/req  failed {run['failed']}  "
        f"pulls fell back {sum(run['pull_fallbacks'].values()):g}  lag {max(run['sim_lag_wall_s'])} s"
    )


def plot(report: dict[str, Any], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(15, 9))
    target = report["conditions"]["slo"]["attainment_target"]
    for name, summary in report["fleets"].items():
        runs = sorted(summary["runs"], key=lambda r: r["offered_requests_per_s"])
        rates = [r["offered_requests_per_s"] for r in runs]
        style = "-" if summary["disaggregation"] != "always" else "--"
        for axis, key in ((axes[0][0], "slo_attainment"), (axes[0][1], "tpot_p90_s"), (axes[1][0], "ttft_p90_s")):
            axis.plot(rates, [r[key] for r in runs], style, marker="o", label=name)
    axes[0][0].axhline(target, color="red", linestyle=":", linewidth=1, label=f"{target:.0%} target")
    axes[0][1].axhline(
        report["conditions"]["slo"]["tpot_s"], color="red", linestyle=":", linewidth=1, label="TPOT bound"
    )
    for axis, label in (
        (axes[0][0], "SLO attainment"),
        (axes[0][1], "TPOT p90 (simulated s, log)"),
        (axes[1][0], "TTFT p90 (simulated s, log)"),
    ):
        axis.set_xlabel("offered requests per simulated s")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    axes[0][1].set_yscale("log")
    axes[1][0].set_yscale("log")
    names = list(report["fleets"])
    axes[1][1].bar(range(len(names)), [report["fleets"][n]["goodput"]["requests_per_s"] for n in names])
    axes[1][1].set_xticks(range(len(names)), [n.replace(" ", "\n", 1).replace(", ", "\n") for n in names], fontsize=8)
    axes[1][1].set_ylabel(f"goodput: requests/s at >= {target:.0%} SLO attainment")
    axes[1][1].grid(alpha=0.3, axis="y")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    sim = SimConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="Mooncake conversation trace (JSONL)")
    parser.add_argument("--requests", type=int, default=400, help="the first N requests of the trace (default: 400)")
    parser.add_argument(
        "--skip",
        type=int,
        default=0,
        help="start the slice after this many requests, arrivals counted from its first (default: 0)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"a quick run: {SMOKE['requests']} requests, loads "
        f"{SMOKE['loads']}, split {SMOKE['splits']}, results to pd_fleet_smoke.*",
    )
    parser.add_argument(
        "--max-output",
        type=int,
        default=1024,
        help="cap on each request's output tokens (default: 1024; the trace's own lengths below it)",
    )
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas of every fleet (default: 8)")
    parser.add_argument(
        "--splits", default="2,3,4", help="prefill replicas of the PD fleets, comma-separated (default: 2,3,4)"
    )
    parser.add_argument(
        "--modes",
        default="conditional,always",
        help="router --disaggregation modes of the PD fleets (default: conditional,always)",
    )
    parser.add_argument(
        "--loads",
        default="0.5,0.7,0.9,1.1",
        help="offered loads, each the fleet's estimated busy fraction, comma-separated (default: 0.5,0.7,0.9,1.1)",
    )
    parser.add_argument(
        "--cost-preset",
        default="h100-llama3-8b",
        choices=[CPU_PRESET, *(p.name for p in ROOFLINE_PRESETS)],
        help="the sims' cost model: a roofline preset, or cpu (measured here) (default: h100-llama3-8b)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=sim.scheduler.max_num_batched_tokens,
        help="sim: every replica's token budget per step (default: %(default)s)",
    )
    parser.add_argument(
        "--prefill-only-step-tokens",
        type=int,
        default=PREFILL_STEP_TOKENS,
        help="sim: the PD replicas' token budget per step while none of their requests streams, as "
        "on a prefill replica (default: %(default)s; 0: --max-num-batched-tokens)",
    )
    parser.add_argument(
        "--unified-step-tokens",
        default=f"{PREFILL_STEP_TOKENS},2048/{PREFILL_STEP_TOKENS}",
        help="also run unified fleets with these step budgets, comma-separated: N for every step, "
        "A/B for A while a request streams and B while none does, so that the best unified fleet is "
        "compared (default: %(default)s; '': none)",
    )
    parser.add_argument(
        "--ttft-slo-factor",
        type=float,
        default=5.0,
        help="TTFT bound: this many times the prompt's prefill alone on an idle replica (default: 5)",
    )
    parser.add_argument(
        "--ttft-slo-min-s", type=float, default=0.5, help="TTFT bound: at least this, simulated seconds (default: 0.5)"
    )
    parser.add_argument("--tpot-slo-s", type=float, default=0.1, help="TPOT bound, simulated seconds (default: 0.1)")
    parser.add_argument(
        "--tpot-slo-grid",
        default="0.025,0.05,0.1,0.2",
        help="goodput is also reported for each of these TPOT bounds, from the same runs (default: 0.025,0.05,0.1,0.2)",
    )
    parser.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="goodput: the SLO attainment a rate must keep (default: 0.9, DistServe's)",
    )
    parser.add_argument(
        "--prefill-order",
        default="fcfs",
        choices=PREFILL_ORDERS,
        help="every replica's order of prompts (kvyard sim --prefill-order; default: %(default)s)",
    )
    parser.add_argument(
        "--pd-local-prefill-tokens",
        type=int,
        default=512,
        help="router: conditional mode "
        "prefills on the decode replica when at most this many tokens are left to compute "
        "(default: 512, the router's own)",
    )
    parser.add_argument(
        "--pd-decode-prefill-budget",
        type=int,
        default=None,
        help="router: conditional mode "
        "lets a decode replica that runs decodes prefill a prompt when the prefill pool would start "
        "it later, while the prefill queued on it stays within this many tokens (default: the "
        "router's own)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=64,
        help="tokens per KV block (default: 64; the trace's "
        "prefixes are shared in 512-token units, so larger blocks lose no hit and make 4x fewer "
        "blocks for the sims to move, index and evict than 16)",
    )
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default: 524,288 tokens' worth, routing.py's 32,768 blocks of 16)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=0.5, help="sim: wall seconds per simulated second (default: 0.5)"
    )
    parser.add_argument(
        "--stream-interval-s",
        type=float,
        default=0.02,
        help="sim: least wall time between "
        "two deliveries of a stream's tokens (default: 0.02; TPOT is measured first to last token, "
        "which batching does not change)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="sim: KV bytes per token of the modeled model (default: the cost preset's)",
    )
    parser.add_argument(
        "--transfer-gb-per-s",
        type=float,
        default=None,
        help="sim: transfer bandwidth, GB/s (default: the cost preset's)",
    )
    parser.add_argument(
        "--shared-store-blocks",
        type=int,
        default=0,
        help="sim: a KV store of this many blocks "
        "shared by every replica (prefill pool included), like kvyard serve's Redis tier; -1: the "
        "slice's working set (default: 0, none)",
    )
    parser.add_argument(
        "--shared-store-gb-per-s",
        type=float,
        default=None,
        help="sim: the shared store's read "
        "bandwidth, GB/s (default: the transfer link's, as a store reached over the same RDMA "
        "network)",
    )
    parser.add_argument(
        "--transfer-latency-s",
        type=float,
        default=sim.transfer_latency_s,
        help=f"sim: simulated seconds per transfer on top of its bytes (default: {sim.transfer_latency_s:g})",
    )
    parser.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=PULL_DEADLINE_S,
        help="sim: longest a "
        "decode replica waits for a pull, remote prefill included, in simulated seconds; then it "
        f"computes the rest itself (default: {PULL_DEADLINE_S:g}, so that fallbacks do not stand "
        "in for disaggregation)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=120.0,
        help="wall seconds a run may take after its "
        "last arrival; then what is unfinished is cut and counts as failed (default: 120)",
    )
    parser.add_argument(
        "--only", action="append", default=[], help="run only fleets whose name contains this (repeatable)"
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "kvyard-pd_fleet-logs",
        help="where the sims' and routers' logs go (default: %(default)s)",
    )
    parser.add_argument(
        "--router-log-level",
        default=None,
        help="the router's --log-level (debug: one line per PD decision in its log under --logs)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the conditions only")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON; the PNG goes beside it "
        "(default: benchmarks/results/pd_fleet.json, or pd_fleet_smoke.json with --smoke)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.drain_s, args.loads, args.splits = (
            SMOKE[k] for k in ("requests", "drain_s", "loads", "splits")
        )
    args.out = args.out or RESULTS / ("pd_fleet_smoke.json" if args.smoke else "pd_fleet.json")
    args.capacity_blocks = args.capacity_blocks or CAPACITY_TOKENS // args.block_size
    return args


def trace_slice(args: argparse.Namespace) -> list[TraceRequest]:
    requests = load_trace(args.trace, args.skip + args.requests, args.max_output)[args.skip :]
    start = requests[0].arrival_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in requests]


def slice_name(args: argparse.Namespace, requests: list[TraceRequest]) -> str:
    return f"requests {args.skip + 1}-{args.skip + len(requests)}"


def cost_model(args: argparse.Namespace) -> CostModel:
    return CostModel() if args.cost_preset == CPU_PRESET else roofline_preset(args.cost_preset).cost


def conditions(args: argparse.Namespace, requests: list[TraceRequest]) -> dict[str, Any]:
    span = max(r.arrival_s for r in requests) or 1.0
    sim = SimConfig()
    preset = None if args.cost_preset == CPU_PRESET else roofline_preset(args.cost_preset)
    return {
        "trace": str(args.trace.name),
        "requests": len(requests),
        "trace_slice": slice_name(args, requests),
        "trace_span_s": span,
        "replicas": args.replicas,
        "capacity_blocks_per_replica": args.capacity_blocks,
        "block_size": args.block_size,
        "max_output": args.max_output,
        "mean_input_tokens": sum(r.input_length for r in requests) / len(requests),
        "mean_output_tokens": sum(r.output_length for r in requests) / len(requests),
        "time_scale": args.time_scale,
        "stream_interval_s": args.stream_interval_s,
        "sim_catch_up_s": sim.catch_up_s,
        "times": "simulated seconds (wall / time_scale); rates per simulated second",
        "cost_preset": args.cost_preset,
        "cost_model_source": "measured: kvyard engine, llama bench preset, fp32, 2 CPU cores"
        if preset is None
        else f"roofline model, not a serving engine measured: {preset.model.name} on {preset.device.name} "
        f"({asdict(preset.device)})",
        "cost_model": asdict(cost_model(args)),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_only_step_tokens": args.prefill_only_step_tokens or args.max_num_batched_tokens,
        "prefill_order": args.prefill_order,
        "kv_bytes_per_token": args.kv_bytes_per_token
        or (preset.model.kv_bytes_per_token if preset else sim.kv_bytes_per_token),
        "transfer_gb_per_s": transfer_gb_per_s(args),
        "transfer_link": preset.transfer_note if preset else "10 Gb/s Ethernet",
        "transfer_latency_s": args.transfer_latency_s,
        "kv_transfer_timeout_s": args.kv_transfer_timeout_s,
        "transfer_model": "streamed while prefill runs: after the last block, max(latency + the last chunk's "
        "bytes / bandwidth, latency + all bytes / bandwidth - the time the pull was open)",
        "pd_local_prefill_tokens": args.pd_local_prefill_tokens,
        "pd_decode_prefill_budget": args.pd_decode_prefill_budget or RouterConfig().pd_decode_prefill_budget,
        "drain_s": args.drain_s,
        "ideal_hit_ratio_subset": ideal_hit_ratio(requests),
        "decode_work_share_estimate": decode_share(requests, cost_model(args)),
        "router_policy": "cache_aware",
        "cpus": os.cpu_count(),
        "slo": {
            "ttft": f"max({args.ttft_slo_min_s:g} s, {args.ttft_slo_factor:g} x the prompt's prefill alone "
            f"on an idle replica)",
            "tpot_s": args.tpot_slo_s,
            "attainment_target": args.attainment,
        },
        "provenance": provenance.of_run(),
    }


DECODE_BATCH_ESTIMATE = 16  # decodes sharing a step, for the load estimate only


def work_seconds(requests: list[TraceRequest], cost: CostModel) -> tuple[float, float]:
    """(prefill, decode) simulated busy seconds the trace asks of the fleet: prefills with the ideal hit ratio
    (routing.service_seconds) and decode tokens each with their context read and a share of a step."""
    prefill = (
        service_seconds(requests, ideal_hit_ratio(requests), cost)
        - sum(r.output_length for r in requests) * cost.decode_seq_s
    )
    per_step = cost.step_base_s / DECODE_BATCH_ESTIMATE + cost.decode_seq_s
    decode = sum(
        r.output_length * (per_step + cost.decode_context_s * (r.input_length + r.output_length / 2)) for r in requests
    )
    return prefill, decode


def decode_share(requests: list[TraceRequest], cost: CostModel) -> float:
    prefill, decode = work_seconds(requests, cost)
    return decode / (prefill + decode)


def best_of(fleets: dict[str, Any], found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The best fleet of each kind (unified, PD conditional, PD always) at one SLO, with where its goodput lies
    (`bound`: a ratio is only as good as rates interpolated between loads run), and the ratios the issue asks for:
    the best conditional split over the best unified fleet, and over the best always-disaggregating one."""
    best: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, result in found.items():
        kind = fleets[name]["disaggregation"] or "unified"
        if kind not in best or result["requests_per_s"] > best[kind][1]["requests_per_s"]:
            best[kind] = (name, result)
    summary: dict[str, Any] = {
        kind: {"fleet": name, "goodput": result["requests_per_s"], "bound": result["bound"]}
        for kind, (name, result) in best.items()
    }
    for other in ("unified", "always"):
        if "conditional" in best and other in best and best[other][1]["requests_per_s"] > 0:
            summary[f"conditional_over_{other}"] = (
                best["conditional"][1]["requests_per_s"] / best[other][1]["requests_per_s"]
            )
    return summary


def main() -> int:
    args = parse_args()
    requests = trace_slice(args)
    blocks: dict[int, str] = {}
    prompts = [prompt_text(r, blocks) for r in requests]
    span = max(r.arrival_s for r in requests) or 1.0
    work = sum(work_seconds(requests, cost_model(args)))
    report: dict[str, Any] = {"conditions": conditions(args, requests)}
    report["conditions"]["working_set_blocks"] = len(blocks) * TRACE_BLOCK // args.block_size
    if args.shared_store_blocks < 0:
        args.shared_store_blocks = report["conditions"]["working_set_blocks"]
    if args.shared_store_blocks:
        args.shared_store_gb_per_s = args.shared_store_gb_per_s or transfer_gb_per_s(args)
    report["conditions"]["shared_store"] = {"blocks": args.shared_store_blocks, "gb_per_s": args.shared_store_gb_per_s}
    report["conditions"]["work_seconds_estimate"] = work
    print(json.dumps(report["conditions"]), flush=True)
    if args.dry_run:
        return 0
    splits = [int(s) for s in args.splits.split(",") if s.strip()]
    unified_steps = [s.strip() for s in args.unified_step_tokens.split(",") if s.strip()]
    selected = [
        f
        for f in fleets(args.replicas, splits, args.modes.split(","), unified_steps)
        if not args.only or any(pattern in f.name for pattern in args.only)
    ]
    args.logs.mkdir(parents=True, exist_ok=True)
    bounds = ttft_bounds(args, requests)
    report["fleets"] = {}
    for fleet in selected:
        runs = []
        for load in (float(x) for x in args.loads.split(",")):
            speedup = load * args.replicas * span / (work * args.time_scale)
            run, rows = run_fleet(fleet, args, requests, prompts, speedup, args.logs)
            run.update(
                offered_load=load,
                offered_requests_per_s=len(requests) / (work / (load * args.replicas)),
                arrival_speedup=speedup,
                per_request_ttft_tpot_s=rows,
            )
            runs.append(with_attainment(run, rows, bounds, args.tpot_slo_s))
            print(table_row(runs[-1]), flush=True)
        report["fleets"][fleet.name] = {
            "prefill_replicas": fleet.prefill_replicas,
            "disaggregation": fleet.disaggregation,
            "runs": runs,
            "goodput": goodput(runs, args.attainment),
        }
    report["goodput_requests_per_s"] = {name: f["goodput"]["requests_per_s"] for name, f in report["fleets"].items()}
    by_bound = {
        bound: {
            name: goodput(
                [with_attainment(r, r["per_request_ttft_tpot_s"], bounds, float(bound)) for r in f["runs"]],
                args.attainment,
            )
            for name, f in report["fleets"].items()
        }
        for bound in args.tpot_slo_grid.split(",")
    }
    report["goodput_by_tpot_slo"] = {
        bound: {name: g["requests_per_s"] for name, g in found.items()} for bound, found in by_bound.items()
    }
    report["best_by_tpot_slo"] = {bound: best_of(report["fleets"], found) for bound, found in by_bound.items()}
    args.out.write_text(json.dumps(report, indent=1))
    title = (
        f"Mooncake conversation trace, {slice_name(args, requests)}, {args.replicas} simulated replicas, "
        f"cost model {args.cost_preset}; SLO: TTFT <= {report['conditions']['slo']['ttft']}, TPOT <= "
        f"{args.tpot_slo_s:g} s"
    )
    plot(report, title, args.out.with_suffix(".png"))
    print(
        json.dumps(report["goodput_by_tpot_slo"], indent=1),
        json.dumps(report["best_by_tpot_slo"], indent=1),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

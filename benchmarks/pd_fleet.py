"""PD fleet benchmark: prefill/decode disaggregation against unified replicas, Mooncake trace, simulated fleet.

Every configuration has the same `--replicas` (8) simulated replicas (one `kvyard sim` process, per-replica prefix
cache smaller than the working set) behind kvyard's router: all unified with `--policy cache_aware`, and each split
of P prefill plus 8-P decode replicas (`--splits`, default 2, 3 and 4) under `--disaggregation conditional` and
`always`. Each run replays the first `--requests` requests of the Mooncake conversation trace at their (sped-up)
arrival times as streaming completions, prompts and users built as in routing.py (one byte per token, equal hash
ids give equal prefixes, `user = conv-<second hash id>`), each asking for its trace output length (capped by
`--max-output`) with `ignore_eos`. The arrival speed-up makes the fleet's simulated work fill `--utilisation`
of all replicas, as in routing.py; the same arrivals go to every configuration.

Per request the client records TTFT (time to the first streamed token) and TPOT ((last token - first token) /
(output tokens - 1), requests of one token have none). Times are reported in **simulated seconds** (wall
seconds / time scale), the time of the CPU engine the sim's cost model was calibrated on; fixed wall costs of
HTTP and the router are magnified by 1 / time scale the same way for every configuration, more often for PD (two
legs and a pull). Goodput, DistServe-style, is the rate of requests that finished with TTFT <= the TTFT bound
AND TPOT <= the TPOT bound. Unless `--ttft-slo-s` / `--tpot-slo-s` are given, each bound is the unified run's own
90th percentile of that metric: the tightest bounds the unified fleet meets for 90 % of requests, DistServe's
attainment target, metric by metric (it meets both together for 80-90 %). They are chosen from the baseline
alone, before any PD number is looked at. Transfer bytes per request are the decode sims' modeled KV bytes
(`kvyard_sim_transfer_model_bytes_total`: blocks pulled x block size x `--kv-bytes-per-token`) over the completed
requests; each pull is charged latency + bytes / bandwidth of simulated time (`kvyard sim --help`). A run that
has not finished `--drain-s` wall seconds after the last arrival is cut: its unfinished requests count as failed.

    .venv/bin/python benchmarks/pd_fleet.py                 # full size: benchmarks/results/pd_fleet.{json,png}
    .venv/bin/python benchmarks/pd_fleet.py --smoke         # about 2 minutes: benchmarks/results/pd_fleet_smoke.*
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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

from kvyard.sim.config import SimConfig
from kvyard.sim.cost_model import CostModel

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ADMIN_KEY = "pd-fleet-benchmark-admin"  # the sims' admin plane (KV events, transfers) and the router's
# Longer than any prefill of the default slice alone (its longest prompt, 120k tokens, takes about 1,100 simulated
# seconds), so a pull ends when its prefill ends unless queueing adds most of an hour.
PULL_DEADLINE_S = 3600.0
SLO_QUANTILE = 0.9  # DistServe's attainment target: the default bounds are the unified run's 90th percentiles
SMOKE = {"requests": 40, "drain_s": 15.0}
Sample = tuple[float | None, float | None]  # one request's (TTFT, TPOT), simulated seconds; TTFT None: it failed


@dataclass(frozen=True, slots=True)
class Fleet:
    name: str
    prefill_replicas: int  # 0: every replica unified
    disaggregation: str | None = None


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


def fleets(replicas: int, splits: list[int], modes: list[str]) -> list[Fleet]:
    runs = [Fleet(f"unified cache_aware ({replicas})", 0)]
    runs += [Fleet(f"{p}P+{replicas - p}D {mode}", p, mode) for p in splits for mode in modes]
    return runs


# ---------------------------------------------------------------------------- processes


def start_sims(args: argparse.Namespace, fleet: Fleet, log: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    ports_file = log.with_suffix(".ports.json")
    ports_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "kvyard", "sim", "--replicas", str(args.replicas), "--prefill-replicas",
               str(fleet.prefill_replicas), "--port", "0", "--ports-file", str(ports_file), "--num-kv-blocks",
               str(args.capacity_blocks), "--time-scale", str(args.time_scale), "--stream-interval-s",
               str(args.stream_interval_s), "--kv-bytes-per-token", str(args.kv_bytes_per_token),
               "--transfer-gb-per-s", str(args.transfer_gb_per_s), "--transfer-latency-s",
               str(args.transfer_latency_s), "--kv-transfer-timeout-s", str(args.kv_transfer_timeout_s),
               "--admin-key", ADMIN_KEY]  # fmt: skip
    return launch_sims(command, ports_file, log)


def start_router(args: argparse.Namespace, fleet: Fleet, workers: list[str], log: Path) -> tuple[
        subprocess.Popen[bytes], str]:  # fmt: skip
    port = free_port()
    command = [sys.executable, "-m", "kvyard", "route", "--port", str(port), "--policy", "cache_aware",
               "--admin-key", ADMIN_KEY, "--replica-admin-key", ADMIN_KEY]  # fmt: skip
    if fleet.disaggregation is not None:
        command += ["--disaggregation", fleet.disaggregation, "--pd-local-prefill-tokens",
                    str(args.pd_local_prefill_tokens)]  # fmt: skip
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
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "user": user}  # fmt: skip
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
    """Every sample of a /metrics page, by its name with labels."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def labelled(samples: dict[str, float], prefix: str) -> dict[str, float]:
    """`{label value: sample}` of a metric with one label."""
    return {name.split('"')[1]: value for name, value in samples.items() if name.startswith(prefix + "{")}


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
    }


def summarize(fleet: Fleet, results: list[Result], elapsed_wall: float, time_scale: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s / time_scale for r in done]
    tpots = [t / time_scale for r in done if (t := r.tpot_s) is not None]
    elapsed = elapsed_wall / time_scale
    return {
        "fleet": fleet.name, "prefill_replicas": fleet.prefill_replicas, "disaggregation": fleet.disaggregation,
        "completed": len(done), "failed": len(results) - len(done),
        "failed_statuses": sorted({r.status for r in results if not r.ok}),
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "tpot_p50_s": percentile(tpots, 0.5), "tpot_p99_s": percentile(tpots, 0.99),
        "requests_per_s": len(done) / elapsed, "output_tokens_per_s": sum(r.output_tokens for r in done) / elapsed,
        "hit_ratio": sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_tokens for r in done)),
        "elapsed_s": elapsed, "elapsed_wall_s": elapsed_wall,
    }  # fmt: skip


def sample(result: Result, time_scale: float) -> Sample:
    if not result.ok:
        return None, None
    tpot = result.tpot_s
    return round(result.ttft_s / time_scale, 4), None if tpot is None else round(tpot / time_scale, 5)


def meets(row: Sample, ttft_slo: float, tpot_slo: float) -> bool:
    """Finished within both bounds (a request of one token has no TPOT to miss)."""
    ttft, tpot = row
    return ttft is not None and ttft <= ttft_slo and (tpot is None or tpot <= tpot_slo)


def with_goodput(run: dict[str, Any], rows: list[Sample], ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    if math.isnan(ttft_slo) or math.isnan(tpot_slo):  # no unified run to take the bounds from
        return {**run, "goodput_requests_per_s": None, "slo_attainment": None}
    good = sum(meets(row, ttft_slo, tpot_slo) for row in rows)
    return {**run, "goodput_requests_per_s": good / run["elapsed_s"], "slo_attainment": good / max(1, len(rows))}


def run_fleet(fleet: Fleet, args: argparse.Namespace, requests: list[TraceRequest], prompts: list[str],
              speedup: float, logs: Path) -> tuple[dict[str, Any], list[Sample]]:  # fmt: skip
    slug = fleet.name.split(" (")[0].replace(" ", "_").replace("+", "_")
    sims, workers = start_sims(args, fleet, logs / f"sim-{slug}.log")
    router, url = start_router(args, fleet, workers, logs / f"router-{slug}.log")
    try:
        asyncio.run(wait_fleet(url, len(workers), 90))
        results, elapsed = asyncio.run(replay(url, requests, prompts, speedup, args.drain_s))
        summary = summarize(fleet, results, elapsed, args.time_scale)
        summary.update(asyncio.run(fleet_metrics(url, workers, fleet)))
        summary["transfer_bytes_per_request"] = summary["modeled_transfer_bytes"] / max(1, summary["completed"])
        print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}), flush=True)
        return summary, [sample(r, args.time_scale) for r in results]
    finally:
        stop([router, sims])


# ---------------------------------------------------------------------------- report


def slo_bounds(args: argparse.Namespace, runs: list[dict[str, Any]], samples: dict[str, list[Sample]]) -> dict[
        str, Any]:  # fmt: skip
    unified = next((r["fleet"] for r in runs if r["prefill_replicas"] == 0), None)
    rows = samples.get(unified or "", [])
    ttfts = [t for t, _ in rows if t is not None]
    tpots = [p for t, p in rows if t is not None and p is not None]
    ttft = args.ttft_slo_s if args.ttft_slo_s is not None else percentile(ttfts, SLO_QUANTILE)
    tpot = args.tpot_slo_s if args.tpot_slo_s is not None else percentile(tpots, SLO_QUANTILE)
    source = "given" if args.ttft_slo_s is not None and args.tpot_slo_s is not None else (
        f"the unified run's p{round(SLO_QUANTILE * 100)}, where not given")  # fmt: skip
    return {"ttft_s": ttft, "tpot_s": tpot, "from": source}


def table_row(run: dict[str, Any]) -> str:
    goodput = "n/a" if run["goodput_requests_per_s"] is None else (
        f"{run['goodput_requests_per_s']:.4f} ({run['slo_attainment']:.0%})")  # fmt: skip
    return (f"{run['fleet']:<24} TTFT p50 {run['ttft_p50_s']:7.1f} p99 {run['ttft_p99_s']:7.1f}  TPOT p50 "
            f"{run['tpot_p50_s']:.4f} p99 {run['tpot_p99_s']:.4f}  {run['requests_per_s']:.4f} req/s  goodput "
            f"{goodput}  {run['transfer_bytes_per_request'] / 1e6:.1f} MB/req  failed {run['failed']}  pulls fell "
            f"back {sum(run['pull_fallbacks'].values()):g}")  # fmt: skip


LABELS = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "tpot_p50_s": "TPOT p50", "tpot_p99_s": "TPOT p99",
          "requests_per_s": "throughput", "goodput_requests_per_s": "goodput (both SLOs met)",
          "transfer_bytes_per_request": "modeled KV bytes pulled"}  # fmt: skip


def plot(runs: list[dict[str, Any]], slo: dict[str, Any], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["fleet"].replace(" cache_aware", "\ncache_aware").replace(" ", "\n", 1) for r in runs]
    positions = list(range(len(runs)))
    figure, axes = plt.subplots(2, 2, figsize=(15, 9))
    panels = [
        (axes[0][0], ("ttft_p50_s", "ttft_p99_s"), "TTFT (simulated s, log)", slo["ttft_s"], True),
        (axes[0][1], ("tpot_p50_s", "tpot_p99_s"), "TPOT (simulated s, log)", slo["tpot_s"], True),
        (axes[1][0], ("requests_per_s", "goodput_requests_per_s"), "requests per simulated s", None, False),
        (axes[1][1], ("transfer_bytes_per_request",), "modeled KV transfer per request (MB)", None, False),
    ]
    for axis, keys, label, bound, log in panels:
        width = 0.8 / len(keys)
        for index, key in enumerate(keys):
            scale = 1e-6 if key == "transfer_bytes_per_request" else 1.0
            values = [(r.get(key) or 0.0) * scale for r in runs]
            axis.bar([p + (index - (len(keys) - 1) / 2) * width for p in positions], values, width,
                     label=LABELS[key])  # fmt: skip
        if bound is not None and not math.isnan(bound):
            axis.axhline(bound, color="red", linestyle="--", linewidth=1, label=f"SLO bound {bound:.3g} s")
        if log:
            axis.set_yscale("log")
        axis.set_xticks(positions, names, fontsize=8)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3, axis="y")
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    sim = SimConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="Mooncake conversation trace (JSONL)")
    parser.add_argument("--requests", type=int, default=800, help="the first N requests of the trace (default: 800)")
    parser.add_argument("--smoke", action="store_true", help=f"a quick run: {SMOKE['requests']} requests, "
                        f"{SMOKE['drain_s']:g} s drain, results to pd_fleet_smoke.*")  # fmt: skip
    parser.add_argument("--max-output", type=int, default=1024, help="cap on each request's output tokens "
                        "(default: 1024; the trace's own lengths below it)")  # fmt: skip
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas of every fleet (default: 8)")
    parser.add_argument("--splits", default="2,3,4", help="prefill replicas of the PD fleets, comma-separated "
                        "(default: 2,3,4)")  # fmt: skip
    parser.add_argument("--modes", default="conditional,always", help="router --disaggregation modes of the PD "
                        "fleets (default: conditional,always)")  # fmt: skip
    parser.add_argument("--pd-local-prefill-tokens", type=int, default=512, help="router: conditional mode "
                        "prefills on the decode replica when at most this many tokens are left to compute "
                        "(default: 512, the router's own)")  # fmt: skip
    parser.add_argument("--capacity-blocks", type=int, default=32768, help="KV blocks (16 tokens) per replica "
                        "(default: 32768, as routing.py)")  # fmt: skip
    parser.add_argument("--time-scale", type=float, default=0.01, help="sim: wall seconds per simulated second "
                        "(default: 0.01)")  # fmt: skip
    parser.add_argument("--stream-interval-s", type=float, default=0.002, help="sim: least wall time between "
                        "two deliveries of a stream's tokens (default: 0.002)")  # fmt: skip
    parser.add_argument("--kv-bytes-per-token", type=int, default=sim.kv_bytes_per_token, help="sim: KV bytes "
                        f"per token of the modeled model (default: {sim.kv_bytes_per_token}, the cost model's "
                        "llama bench preset in float32)")  # fmt: skip
    parser.add_argument("--transfer-gb-per-s", type=float, default=sim.transfer_gb_per_s, help="sim: transfer "
                        f"bandwidth, GB/s (default: {sim.transfer_gb_per_s:g}, 10 Gb/s Ethernet)")  # fmt: skip
    parser.add_argument("--transfer-latency-s", type=float, default=sim.transfer_latency_s, help="sim: simulated "
                        f"seconds per transfer on top of its bytes (default: {sim.transfer_latency_s:g})")  # fmt: skip
    parser.add_argument("--kv-transfer-timeout-s", type=float, default=PULL_DEADLINE_S, help="sim: longest a "
                        "decode replica waits for a pull, remote prefill included, in simulated seconds; then it "
                        f"computes the rest itself (default: {PULL_DEADLINE_S:g}; the engine's own "
                        f"{sim.kv_transfer.kv_transfer_timeout_s:g} is shorter than this cost model's prefill of "
                        "the trace's long prompts, so it measures fallbacks rather than disaggregation)")  # fmt: skip
    parser.add_argument("--utilisation", type=float, default=0.8, help="offered load as a fraction of the 8 "
                        "replicas' capacity, estimated as in routing.py (default: 0.8)")  # fmt: skip
    parser.add_argument("--drain-s", type=float, default=300.0, help="wall seconds a run may take after its "
                        "last arrival; then what is unfinished is cut and counts as failed (default: 300)")  # fmt: skip
    parser.add_argument("--ttft-slo-s", type=float, default=None, help="goodput's TTFT bound, simulated seconds "
                        "(default: the unified run's p90 TTFT)")  # fmt: skip
    parser.add_argument("--tpot-slo-s", type=float, default=None, help="goodput's TPOT bound, simulated seconds "
                        "(default: the unified run's p90 TPOT)")  # fmt: skip
    parser.add_argument("--only", action="append", default=[], help="run only fleets whose name contains this "
                        "(repeatable); the default SLO bounds need the unified fleet")  # fmt: skip
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "kvyard-pd_fleet-logs",
                        help="where the sims' and routers' logs go (default: %(default)s)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="print the conditions only")
    parser.add_argument("--out", type=Path, default=None, help="result JSON; the PNG goes beside it "
                        "(default: benchmarks/results/pd_fleet.json, or pd_fleet_smoke.json with --smoke)")  # fmt: skip
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.drain_s = SMOKE["requests"], SMOKE["drain_s"]
    args.out = args.out or RESULTS / ("pd_fleet_smoke.json" if args.smoke else "pd_fleet.json")
    return args


def conditions(args: argparse.Namespace, requests: list[TraceRequest], speedup: float) -> dict[str, Any]:
    span = max(r.arrival_s for r in requests) or 1.0
    return {
        "trace": str(args.trace.name), "requests": len(requests), "trace_slice": f"first {len(requests)} requests",
        "trace_span_s": span, "arrival_speedup": speedup, "replay_span_wall_s": span / speedup,
        "replicas": args.replicas, "capacity_blocks_per_replica": args.capacity_blocks, "block_size": 16,
        "max_output": args.max_output, "mean_input_tokens": sum(r.input_length for r in requests) / len(requests),
        "mean_output_tokens": sum(r.output_length for r in requests) / len(requests),
        "time_scale": args.time_scale, "stream_interval_s": args.stream_interval_s,
        "times": "simulated seconds (wall / time_scale); rates per simulated second",
        "cost_model": asdict(CostModel()), "max_num_batched_tokens": SimConfig().scheduler.max_num_batched_tokens,
        "kv_bytes_per_token": args.kv_bytes_per_token, "transfer_gb_per_s": args.transfer_gb_per_s,
        "transfer_latency_s": args.transfer_latency_s, "kv_transfer_timeout_s": args.kv_transfer_timeout_s,
        "transfer_model": "latency + blocks x 16 x kv_bytes_per_token"
        " / bandwidth, after the real pull (no overlap with prefill)", "offered_utilisation_estimate":
        args.utilisation, "pd_local_prefill_tokens": args.pd_local_prefill_tokens, "drain_s": args.drain_s,
        "ideal_hit_ratio_subset": ideal_hit_ratio(requests), "prefill_work_share_estimate": prefill_share(requests),
        "router_policy": "cache_aware", "cpus": os.cpu_count(),
    }  # fmt: skip


def prefill_share(requests: list[TraceRequest]) -> float:
    """Prefill's part of the simulated work (routing.service_seconds, which leaves out decode's attention and step
    overhead, so an upper estimate): what decides how many replicas prefill needs."""
    cost = CostModel()
    decode = sum(r.output_length for r in requests) * cost.decode_seq_s
    total = service_seconds(requests, ideal_hit_ratio(requests))
    return (total - decode) / total


def main() -> int:
    args = parse_args()
    requests = load_trace(args.trace, args.requests, args.max_output)
    blocks: dict[int, str] = {}
    prompts = [prompt_text(r, blocks) for r in requests]
    span = max(r.arrival_s for r in requests) or 1.0
    speedup = args.utilisation * args.replicas * span / (service_seconds(requests, ideal_hit_ratio(requests))
                                                         * args.time_scale)  # fmt: skip
    report: dict[str, Any] = {"conditions": conditions(args, requests, speedup)}
    report["conditions"]["working_set_blocks"] = len(blocks) * TRACE_BLOCK // 16
    print(json.dumps(report["conditions"]), flush=True)
    if args.dry_run:
        return 0
    splits = [int(s) for s in args.splits.split(",") if s.strip()]
    selected = [f for f in fleets(args.replicas, splits, args.modes.split(","))
                if not args.only or any(pattern in f.name for pattern in args.only)]  # fmt: skip
    logs = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    samples: dict[str, list[Sample]] = {}
    for fleet in selected:
        run, per_request = run_fleet(fleet, args, requests, prompts, speedup, logs)
        runs.append(run)
        samples[fleet.name] = per_request
    slo = slo_bounds(args, runs, samples)
    report["conditions"]["slo"] = slo
    report["runs"] = [with_goodput(r, samples[r["fleet"]], slo["ttft_s"], slo["tpot_s"]) for r in runs]
    report["per_request_ttft_tpot_s"] = samples
    args.out.write_text(json.dumps(report, indent=1))
    title = (f"Mooncake conversation trace, first {len(requests)} requests, {args.replicas} simulated replicas, "
             f"time scale {args.time_scale:g}; goodput: TTFT <= {slo['ttft_s']:.3g} s and TPOT <= "
             f"{slo['tpot_s']:.3g} s ({slo['from']})")  # fmt: skip
    plot(report["runs"], slo, title, args.out.with_suffix(".png"))
    for run in report["runs"]:
        print(table_row(run), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Routing benchmark: kvyard's policies and the PyPI routers on the same simulated fleet, Mooncake trace.

For every router under test: start 8 fresh simulated replicas (one process, per-replica prefix cache smaller
than the working set), start the router in front of them, replay the first `--requests` requests of the
Mooncake conversation trace at their (sped-up) arrival times as streaming completions, and record TTFT,
throughput and the fleet-wide prefix hit ratio (cached / prompt tokens, from each response's usage). Each
512-token trace block becomes 512 bytes of text derived from its hash id (the simulated replica tokenizes one
token per byte), so every router sees plain text prompts and equal hash ids give equal prefixes. Each
request carries `user = conv-<its second hash id>` (one id per conversation), as a chat client would. The
arrival speed-up is chosen so the fleet's simulated work (sim cost model, ideal hit ratio) fills
`--utilisation` of its capacity, over the whole replay or, with `--utilisation-window-s`, in its busiest window
of that length (each window's work at its own unlimited-cache hit ratio); each run reports the sim's lag, the
time the replicas ran behind their cost model because the machine could not keep up (small against the replay
span means the timing held). Besides TTFT, each run reports the percentiles of TTFT minus each request's floor
(`ttft_floors`: its prefill alone on an idle replica holding every block computed before it): the time lost to
queues and recomputing, which the longest prompts' own prefill does not hide.

Hit ratios are written next to two references computed from the requests alone, at the sim's block size: an
unlimited cache, and one LRU cache as large as the whole fleet (`lru_hit_ratios`), which is about what a
router that keeps conversations home on balanced LRU replicas can reach. Hit ratios move by about ±0.005 from
run to run, so `--repeats N` runs every router N times (round by round) and `summary` gives mean, min and max.

A second phase measures router overhead: CPU seconds of the router process per proxied request and
requests/s, with one simulated replica answering 1-token completions.

    .venv/bin/python benchmarks/routing.py --out benchmarks/results/routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvyard.bench import provenance
from kvyard.sim.cost_model import CostModel

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
PEERS = Path(os.environ.get("KVYARD_PEERS_DIR", "/opt/kvyard-peers")) / "routers"
TRACE_BLOCK = 512
MODEL = "kvyard-sim"
MAX_BATCH_TOKENS = 2048  # the sim's default token budget per step
ADMIN_KEY = "routing-benchmark-admin"  # the sims' admin plane (KV events), which kvyard's router follows
SOURCES = ("device", "local", "shared")
PARITY_METRICS = {
    "predicted": "kvyard_router_predicted_cached_tokens_by_source_total",
    "reported": "kvyard_router_reported_cached_tokens_by_source_total",
    "abs_error": "kvyard_router_cached_tokens_abs_error_total",
}
SIM_LAG_LIMIT_S = 5.0  # a round whose simulator fell further behind measured the machine, not the router


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class Result:
    ok: bool
    status: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_chunks: int = 0
    cached_by_source: dict[str, int] = field(default_factory=dict)  # device, local, shared (kvyard replicas)
    error: str = ""  # why a request failed without an HTTP status: the client's exception, by class name
    error_message: str = ""
    sent_s: float = 0.0  # when it was sent, seconds into the replay
    replica: str = ""  # the replica that served it, where the router says (kvyard's X-Kvyard-Replica)


@dataclass(slots=True)
class Target:
    name: str
    command: list[str] = field(default_factory=list)  # {port} and {workers} are filled in
    by_default: bool = True  # variants that only run when `--only` names them


def load_trace(path: Path, count: int, max_output: int) -> list[TraceRequest]:
    requests = []
    with path.open() as lines:
        for line in lines:
            record = json.loads(line)
            output = min(max_output, record["output_length"])
            arrival = record["timestamp"] / 1000
            requests.append(TraceRequest(arrival, record["input_length"], output, tuple(record["hash_ids"])))
            if len(requests) == count:
                break
    return requests


def prompt_text(request: TraceRequest, blocks: dict[int, str]) -> str:
    parts = []
    for hash_id in request.hash_ids:
        text = blocks.get(hash_id)
        if text is None:
            rng = random.Random(hash_id)
            text = blocks[hash_id] = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=TRACE_BLOCK))
        parts.append(text)
    return "".join(parts)[: request.input_length]


def ideal_hit_ratio(requests: list[TraceRequest], seen: set[int] | None = None) -> float:
    """Hit ratio of an unlimited cache in trace blocks; `seen`: the blocks of earlier requests, updated."""
    seen = set() if seen is None else seen
    hits = total = 0
    for request in requests:
        for hash_id in request.hash_ids:
            hits += hash_id in seen
            total += 1
            seen.add(hash_id)
    return hits / max(1, total)


def lru_hit_ratios(requests: list[TraceRequest], capacities: list[int], block_size: int = 16) -> list[float]:
    """Hit ratio of one LRU prefix cache of each capacity (in blocks) serving the requests in arrival order,
    evicting a released prompt's tail before its prefix as the sim does. With every conversation kept on one
    replica and the work balanced, each replica's LRU evicts at the fleet's average rate, so the fleet behaves
    about like one LRU of the fleet's total size: the reference a router's hit ratio is read against (not a
    strict bound)."""
    caches: list[OrderedDict[tuple[int, int], None]] = [OrderedDict() for _ in capacities]
    hits = [0] * len(capacities)
    total = 0
    for request in requests:
        keys = block_keys(request, block_size)
        matchable = keys[: (request.input_length - 1) // block_size]  # the last token is always computed
        total += request.input_length
        for index, (cache, capacity) in enumerate(zip(caches, capacities, strict=True)):
            hits[index] += _matched_blocks(cache, matchable) * block_size
            for key in reversed(keys):
                cache[key] = None
                cache.move_to_end(key)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return [h / max(1, total) for h in hits]


def _matched_blocks(cache: Container[tuple[int, int]], keys: list[tuple[int, int]]) -> int:
    for matched, key in enumerate(keys):
        if key not in cache:
            return matched
    return len(keys)


def block_keys(request: TraceRequest, block_size: int) -> list[tuple[int, int]]:
    """One key per full block of the prompt: (the chain of trace hash ids up to its trace block, its offset)."""
    per_trace_block = TRACE_BLOCK // block_size
    chain, chains = 0, []
    for hash_id in request.hash_ids:
        chain = hash((chain, hash_id))
        chains.append(chain)
    return [(chains[b // per_trace_block], b % per_trace_block) for b in range(request.input_length // block_size)]


def ttft_floors(requests: list[TraceRequest], time_scale: float, block_size: int = 16) -> list[float]:
    """Each request's least possible TTFT (wall seconds): its prefill alone on an idle replica that holds every
    block any earlier request computed (unlimited cache, nothing loaded), in chunks of the sim's step budget. Each
    request's TTFT under any router is at least its own floor, so each percentile of TTFT is at least the same
    percentile of the floors."""
    cost, seen, floors = CostModel(), set[tuple[int, int]](), []
    for request in requests:
        keys = block_keys(request, block_size)
        cached = _matched_blocks(seen, keys[: (request.input_length - 1) // block_size]) * block_size
        seconds = 0.0
        while cached < request.input_length:
            chunk = min(MAX_BATCH_TOKENS, request.input_length - cached)
            seconds += cost.prefill_seconds(chunk, cached)
            cached += chunk
        floors.append(seconds * time_scale)
        seen.update(keys)
    return floors


def peak_work_rate(requests: list[TraceRequest], window_s: float) -> float:
    """Simulated busy seconds per trace second that the busiest arrival window asks of the fleet, each window's work
    at its own unlimited-cache hit ratio, every earlier request counted (a cold start caches less than the whole
    trace's average)."""
    by_window: dict[int, list[TraceRequest]] = {}
    for request in requests:
        by_window.setdefault(int(request.arrival_s // window_s), []).append(request)
    seen: set[int] = set()
    return max(service_seconds(members, ideal_hit_ratio(members, seen)) for members in by_window.values()) / window_s


def service_seconds(requests: list[TraceRequest], hit_ratio: float, cost: CostModel | None = None) -> float:
    """Simulated busy time the trace asks of the fleet under `cost` (the sim's default cost model unless given),
    with prefills and decodes batched as the sim does and a fraction `hit_ratio` of every prompt cached."""
    cost = cost or CostModel()
    prefill = sum(r.input_length * (1 - hit_ratio) for r in requests) * cost.prefill_token_s
    prefill += sum(r.input_length**2 * (1 - hit_ratio**2) / 2 for r in requests) * cost.attention_pair_s
    prefill_steps = sum(r.input_length * (1 - hit_ratio) for r in requests) / MAX_BATCH_TOKENS * cost.step_base_s
    decode = sum(r.output_length for r in requests) * cost.decode_seq_s
    return prefill + prefill_steps + decode


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_sims(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    ports_file = log.with_suffix(".ports.json")
    ports_file.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "sim",
        "--replicas",
        str(args.replicas),
        "--port",
        "0",
        "--ports-file",
        str(ports_file),
        "--num-kv-blocks",
        str(args.capacity_blocks),
        "--time-scale",
        str(args.time_scale),
        "--stream-interval-s",
        "0.005",
        "--admin-key",
        ADMIN_KEY,
    ]
    if args.host_tier_blocks:
        command += ["--host-tier-blocks", str(args.host_tier_blocks)]
    if args.shared_store_blocks:
        command += ["--shared-store-blocks", str(args.shared_store_blocks)]
    return launch_sims(command, ports_file, log)


def launch_sims(command: list[str], ports_file: Path, log: Path) -> tuple[subprocess.Popen[bytes], list[str]]:
    """Run a `kvyard sim` command line; its process and replica URLs once it has written `ports_file`."""
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ports_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"simulated replicas did not start: {log.read_text()}")
        time.sleep(0.1)
    time.sleep(0.2)
    urls: list[str] = json.loads(ports_file.read_text())["urls"]
    return process, urls


def targets(selected: list[str]) -> list[Target]:
    kvyard = [
        sys.executable,
        "-m",
        "kvyard",
        "route",
        "--port",
        "{port}",
        "--replica-admin-key",
        ADMIN_KEY,
        "{replica-args}",
    ]
    sglang = [
        str(PEERS / "sglang-router/bin/python"),
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--worker-urls",
        "{workers}",
    ]
    smg = [
        str(PEERS / "smg/bin/smg"),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--disable-tokenizer-autoload",
        "--worker-urls",
        "{workers}",
    ]
    vllm = [
        str(PEERS / "vllm-router/bin/vllm-router"),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--worker-urls",
        "{workers}",
    ]
    every = [
        Target(f"kvyard {p}", [*kvyard, "--policy", p]) for p in ("cache_aware", "least_load", "session", "round_robin")
    ]
    every += [
        Target(
            f"kvyard cache_aware sw{w}",
            [*kvyard, "--policy", "cache_aware", "--session-recompute-weight", w],
            by_default=False,
        )
        for w in ("10", "1000")
    ]
    every += [
        Target(
            f"kvyard cache_aware cw{w}",
            [*kvyard, "--policy", "cache_aware", "--conversation-weight", w],
            by_default=False,
        )
        for w in ("0", "3")
    ]
    every += [
        Target(
            f"kvyard cache_aware long{f}x{w}",
            [*kvyard, "--policy", "cache_aware", "--long-prompt-factor", f, "--long-prompt-weight", w],
            by_default=False,
        )
        for f in ("4", "8", "16")
        for w in ("1", "4")
    ]
    every += [
        Target("sglang-router cache_aware", [*sglang, "--policy", "cache_aware"]),
        Target("smg cache_aware", [*smg, "--policy", "cache_aware"]),
        Target("vllm-router cache_aware", [*vllm, "--policy", "cache_aware"]),
        Target("vllm-router round_robin", [*vllm, "--policy", "round_robin"]),
    ]
    if not selected:
        return [t for t in every if t.by_default]
    return [t for t in every if any(_selects(s, t.name) for s in selected)]


def _selects(pattern: str, name: str) -> bool:
    """`--only` matches names containing the pattern, or exactly the name when it ends with '$'."""
    return name == pattern[:-1] if pattern.endswith("$") else pattern in name


def expand(command: list[str], port: int, workers: list[str]) -> list[str]:
    out: list[str] = []
    for part in command:
        if part == "{workers}":
            out += workers
        elif part == "{replica-args}":
            out += [item for url in workers for item in ("--replica", url)]
        else:
            out.append(part.replace("{port}", str(port)))
    return out


async def wait_ready(url: str, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
    """Until the router at `url` lists a model; a router `process` that exits (a port taken, say) ends the wait."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"router exited with status {process.returncode} before it was ready")
            try:
                async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200 and json.loads(await response.read()).get("data"):
                        await asyncio.sleep(1.0)  # let health checks and event streams settle
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"router at {url} not ready after {timeout}s")


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
    result = Result(ok=False)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            result.status = response.status
            result.replica = response.headers.get("X-Kvyard-Replica", "")
            if response.status != 200:
                await response.read()
                return result
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and result.output_chunks == 0:
                    result.ttft_s = time.perf_counter() - started
                if chunk.get("choices"):
                    result.output_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                    result.cached_by_source = details.get("cached_tokens_by_source") or {}
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        result.error = type(error).__name__
        result.error_message = str(error)[:120]
        return result
    result.latency_s = time.perf_counter() - started
    result.ok = result.output_chunks > 0
    return result


async def replay(
    url: str, requests: list[TraceRequest], prompts: list[str], speedup: float
) -> tuple[list[Result], float]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # new connection per request: no reuse stalls
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def at_arrival(index: int) -> Result:
            request = requests[index]
            await asyncio.sleep(max(0.0, start + request.arrival_s / speedup - time.perf_counter()))
            user = f"conv-{request.hash_ids[1] if len(request.hash_ids) > 1 else index}"
            sent_s = time.perf_counter() - start
            result = await one_request(session, url, prompts[index], request.output_length, user)
            result.sent_s = sent_s
            return result

        results = await asyncio.gather(*(at_arrival(i) for i in range(len(requests))))
        return list(results), time.perf_counter() - start


async def sim_lag(workers: list[str]) -> float:
    """The most any simulated replica ran behind its cost model (wall seconds): near 0 means the machine kept up."""
    lags = []
    async with aiohttp.ClientSession() as session:
        for url in workers:
            async with session.get(f"{url}/metrics") as response:
                text = await response.text()
            lags += [float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvyard_sim_lag_seconds")]
    return max(lags, default=0.0)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def across_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per router: mean, min and max of each headline number over the rounds it completed, leaving out rounds whose
    simulator fell more than SIM_LAG_LIMIT_S behind its cost model (the machine was busy elsewhere: their TTFTs
    measure that, not the router); `lagged_rounds` counts them."""
    by_router: dict[str, list[dict[str, Any]]] = {}
    lagged: Counter[str] = Counter()
    for run in runs:
        if "skipped" in run:
            continue
        if run.get("sim_lag_s_max", 0.0) > SIM_LAG_LIMIT_S:
            lagged[run["router"]] += 1
            continue
        by_router.setdefault(run["router"], []).append(run)
    summary = []
    for router, completed in by_router.items():
        row: dict[str, Any] = {"router": router, "rounds": len(completed), "lagged_rounds": lagged[router]}
        for metric in ("hit_ratio", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_excess_p99_s", "requests_per_s"):
            row[metric] = spread([run[metric] for run in completed])
        summary.append(row)
    return summary


def summarize(name: str, results: list[Result], elapsed: float, floors: list[float]) -> dict[str, Any]:
    """`floors`: each request's TTFT floor (`ttft_floors`), in trace order like `results`. TTFT minus its floor is
    the time a request lost to queueing and recomputing under this router; its percentiles are not bounded by the
    longest prompts' prefill the way TTFT's are."""
    done = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in done]
    excess = [r.ttft_s - floor for r, floor in zip(results, floors, strict=True) if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    by_source = {source: sum(r.cached_by_source.get(source, 0) for r in done) / max(1, prompt) for source in SOURCES}
    return {
        "router": name,
        "completed": len(done),
        "failed": len(results) - len(done),
        "failed_statuses": sorted({r.status for r in results if not r.ok}),
        "failed_errors": dict(Counter(r.error for r in results if r.error)),
        "failed_messages": dict(Counter(r.error_message for r in results if r.error_message).most_common(5)),
        "failed_by_replay_minute": dict(sorted(Counter(int(r.sent_s // 60) for r in results if not r.ok).items())),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_excess_p50_s": percentile(excess, 0.5),
        "ttft_excess_p99_s": percentile(excess, 0.99),
        "requests_per_s": len(done) / elapsed,
        "output_chunks_per_s": sum(r.output_chunks for r in done) / elapsed,
        "hit_ratio": sum(r.cached_tokens for r in done) / max(1, prompt),
        "hit_ratio_by_source": by_source,
        "elapsed_s": elapsed,
    }


def write_per_request(path: Path, results: list[Result], floors: list[float]) -> None:
    """One JSON line per request, in trace order, for looking into a tail: when it was sent, its TTFT beside its
    floor, and where its cached tokens came from."""
    with path.open("w") as out:
        for index, (result, floor) in enumerate(zip(results, floors, strict=True)):
            record = {
                "index": index,
                "ok": result.ok,
                "sent_s": round(result.sent_s, 3),
                "ttft_s": round(result.ttft_s, 4),
                "floor_s": round(floor, 4),
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens,
                "cached_by_source": result.cached_by_source,
                "replica": result.replica,
            }
            out.write(json.dumps(record) + "\n")


async def router_parity(url: str) -> dict[str, Any]:
    """kvyard's router: predicted vs reported cached tokens by source, and the sum of per-request errors, each
    as a fraction of the reported total (docs/contracts.md §7)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    sums: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for kind, name in PARITY_METRICS.items():
            if line.startswith(name + "{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                sums.setdefault(source, {}).setdefault(kind, 0.0)
                sums[source][kind] += float(line.rsplit(" ", 1)[1])
    reported_total = sum(values.get("reported", 0.0) for values in sums.values()) or 1.0
    return {
        source: {kind: round(value / reported_total, 4) for kind, value in values.items()}
        for source, values in sorted(sums.items())
    }


def run_target(
    target: Target,
    args: argparse.Namespace,
    requests: list[TraceRequest],
    prompts: list[str],
    speedup: float,
    logs: Path,
    floors: list[float],
    round_number: int,
) -> dict[str, Any]:
    slug = target.name.replace(" ", "_")
    sims, workers = start_sims(args, logs / f"sim-{slug}.log")
    port = free_port()
    command = expand(target.command, port, workers)
    if not Path(command[0]).exists():
        sims.send_signal(signal.SIGTERM)
        sims.wait()
        return {"router": target.name, "skipped": f"{command[0]} is not installed"}
    router = subprocess.Popen(command, stdout=(logs / f"router-{slug}.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url, 90, router))
        results, elapsed = asyncio.run(replay(url, requests, prompts, speedup))
        summary = summarize(target.name, results, elapsed, floors)
        write_per_request(logs / f"requests-{slug}-round{round_number}.jsonl", results, floors)
        summary["sim_lag_s_max"] = asyncio.run(sim_lag(workers))
        if summary["sim_lag_s_max"] > SIM_LAG_LIMIT_S:
            lag = summary["sim_lag_s_max"]
            print(f"{target.name}: the sims lagged {lag:.1f} s: left out of the summary; rerun it", file=sys.stderr)
        if target.name.startswith("kvyard"):
            summary["parity_by_source"] = asyncio.run(router_parity(url))
        print(json.dumps(summary), flush=True)
        return summary
    except RuntimeError as error:
        return {"router": target.name, "skipped": str(error)}
    finally:
        for process in (router, sims):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---------------------------------------------------------------------------- router CPU overhead


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def hammer(url: str, count: int, concurrency: int) -> float:
    body = {"model": MODEL, "prompt": "hello router", "max_tokens": 1}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        queue = iter(range(count))

        async def worker() -> None:
            for _ in queue:
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def overhead(target: Target, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    slug = target.name.replace(" ", "_")
    sim_args = argparse.Namespace(**{**vars(args), "replicas": 1, "time_scale": 0.0001})
    sims, workers = start_sims(sim_args, logs / f"overhead-sim-{slug}.log")
    port = free_port()
    command = expand(target.command, port, workers)
    if not Path(command[0]).exists():
        sims.terminate()
        sims.wait()
        return {"router": target.name, "skipped": f"{command[0]} is not installed"}
    router = subprocess.Popen(command, stdout=(logs / f"overhead-{slug}.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(url, 90))
        asyncio.run(hammer(url, 200, 8))  # warm-up
        cpu_before = cpu_seconds(router.pid)
        elapsed = asyncio.run(hammer(url, args.overhead_requests, 8))
        cpu = cpu_seconds(router.pid) - cpu_before
        result = {
            "router": target.name,
            "cpu_us_per_request": cpu / args.overhead_requests * 1e6,
            "requests_per_s": args.overhead_requests / elapsed,
        }
        print(json.dumps(result), flush=True)
        return result
    finally:
        for process in (router, sims):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with the reason on a value the run cannot use (a zero count would silently replay the whole trace)."""
    positive = {
        "--requests": args.requests,
        "--max-output": args.max_output,
        "--replicas": args.replicas,
        "--capacity-blocks": args.capacity_blocks,
        "--time-scale": args.time_scale,
        "--utilisation": args.utilisation,
        "--repeats": args.repeats,
    }
    for flag, value in positive.items():
        if value <= 0:
            parser.error(f"{flag} must be > 0, got {value}")
    if args.utilisation_window_s < 0:
        parser.error(f"--utilisation-window-s must be >= 0 (0: the whole replay), got {args.utilisation_window_s}")
    if args.host_tier_blocks < 0:
        parser.error(f"--host-tier-blocks must be >= 0 (0: none), got {args.host_tier_blocks}")
    if not args.trace.is_file():
        parser.error(f"--trace: no such file: {args.trace}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=1500, help="the first N requests of the trace")
    parser.add_argument("--max-output", type=int, default=32, help="cap on each request's output length")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--capacity-blocks", type=int, default=32768, help="per replica, 16-token blocks")
    parser.add_argument("--time-scale", type=float, default=0.01, help="sim: wall seconds per simulated second")
    parser.add_argument(
        "--host-tier-blocks",
        type=int,
        default=0,
        help="sim: a host-memory KV tier of this many blocks per replica (0: none)",
    )
    parser.add_argument(
        "--shared-store-blocks",
        type=int,
        default=0,
        help="sim: a KV store of this many blocks shared by all replicas; -1: the working set's size; 0: none",
    )
    parser.add_argument("--utilisation", type=float, default=0.8, help="target offered load of the fleet")
    parser.add_argument(
        "--utilisation-window-s",
        type=float,
        default=0.0,
        help="apply --utilisation to the busiest "
        "window of this many trace seconds instead of the whole replay (0: the whole replay); "
        "long replays have busy stretches that overload a fleet sized for their average",
    )
    parser.add_argument(
        "--only", action="append", default=[], help="run only routers whose name contains this (is it, with a final $)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds; each round runs every router once")
    parser.add_argument("--overhead-requests", type=int, default=2000)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--overhead-only", action="store_true", help="measure router overhead only")
    parser.add_argument("--dry-run", action="store_true", help="print the conditions only")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "routing.json")
    args = parser.parse_args()
    check_args(parser, args)

    requests = load_trace(args.trace, args.requests, args.max_output)
    blocks: dict[int, str] = {}
    prompts = [prompt_text(r, blocks) for r in requests]
    ideal = ideal_hit_ratio(requests)
    pooled, unlimited = lru_hit_ratios(requests, [args.replicas * args.capacity_blocks, sys.maxsize])
    trace_span = max(r.arrival_s for r in requests) or 1.0
    # utilisation = work (wall) / (replicas * replay span); work (wall) = simulated work * time_scale
    work = service_seconds(requests, ideal)
    work_rate = work / trace_span  # simulated busy seconds per trace second
    if args.utilisation_window_s > 0:
        work_rate = peak_work_rate(requests, args.utilisation_window_s)
    speedup = args.utilisation * args.replicas / (work_rate * args.time_scale)
    if args.shared_store_blocks < 0:
        args.shared_store_blocks = len(blocks) * TRACE_BLOCK // 16
    logs = args.out.parent / "routing-logs"
    logs.mkdir(parents=True, exist_ok=True)
    floors = ttft_floors(requests, args.time_scale)
    conditions = {
        "requests": len(requests),
        "trace_span_s": trace_span,
        "arrival_speedup": speedup,
        "replay_span_wall_s": trace_span / speedup,
        "replicas": args.replicas,
        "capacity_blocks_per_replica": args.capacity_blocks,
        "block_size": 16,
        "working_set_blocks": len(blocks) * TRACE_BLOCK // 16,
        "time_scale": args.time_scale,
        "max_output": args.max_output,
        "offered_utilisation_estimate": args.utilisation,
        "utilisation_window_s": args.utilisation_window_s or "whole replay",
        "mean_utilisation_estimate": args.utilisation * work / trace_span / work_rate,
        "ideal_hit_ratio_subset": ideal,
        "trace": args.trace.name,
        "unlimited_cache_hit_ratio": unlimited,
        "pooled_lru_hit_ratio": pooled,
        "rounds": args.repeats,
        "cpus": os.cpu_count(),
        "host_tier_blocks_per_replica": args.host_tier_blocks,
        "shared_store_blocks": args.shared_store_blocks,
        "ttft_floor_s": {"p50": percentile(floors, 0.5), "p99": percentile(floors, 0.99)},
        "provenance": provenance.of_run(),
    }
    print(json.dumps(conditions), flush=True)
    if args.dry_run:
        return 0
    routed = [] if args.overhead_only else targets(args.only)
    results = []
    for round_number in range(1, args.repeats + 1):
        for target in routed:
            run = run_target(target, args, requests, prompts, speedup, logs, floors, round_number)
            results.append({**run, "round": round_number})
    overheads = []
    if not args.skip_overhead:
        measured = (
            "kvyard cache_aware",
            "kvyard round_robin",
            "sglang-router cache_aware",
            "smg cache_aware",
            "vllm-router cache_aware",
        )
        overheads = [overhead(t, args, logs) for t in targets(args.only) if t.name in measured]
    report = {"conditions": conditions, "summary": across_rounds(results), "routing": results, "overhead": overheads}
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

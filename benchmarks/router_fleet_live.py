"""One router process over many simulated replicas, over HTTP: what the router's own process spends.

    .venv/bin/python benchmarks/router_fleet_live.py [--replicas 8,100,1000] [--sim-processes 4]
        [--requests 2000] [--concurrency 32] [--sessions 200] [--idle-s 10] [--out FILE]

For each fleet size: `kvyard sim` processes serve the replicas (KV events on, behind an admin key), and one
`kvyard route` follows all of them as it would real ones (a health check of each every 0.5 s, each replica's
KV-event stream). Measured from /proc: the router's CPU per second while idle (health checks and event streams
alone); then `--requests` completions through it (`--sessions` multi-turn conversations of token-id prompts,
each turn adding 32 tokens, 4 output tokens) and the router's CPU per request beyond its idle rate, requests per
second, and the decision time from the router's own histogram (`kvyard_router_decision_seconds`: the mean, and
p50/p99 as the bucket bounds they fall in). Nothing is asserted: this is a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ADMIN_KEY = "router-fleet-live-admin"
ROUTER_ADMIN_KEY = "router-fleet-live-router-admin"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_sims(total: int, processes: int, scratch: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    sims, files = [], []
    for number in range(processes):
        count = total // processes + (1 if number < total % processes else 0)
        if count == 0:
            continue
        ports = scratch / f"ports-{number}.json"
        command = [
            sys.executable,
            "-m",
            "kvyard",
            "sim",
            "--port",
            "0",
            "--replicas",
            str(count),
            "--ports-file",
            str(ports),
            "--admin-key",
            ADMIN_KEY,
            "--time-scale",
            "0.01",
            "--num-kv-blocks",
            "2048",
            "--log-level",
            "error",
        ]
        sims.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        files.append(ports)
    urls: list[str] = []
    for sim, ports in zip(sims, files):
        while not ports.exists():
            if sim.poll() is not None:
                sys.exit(f"kvyard sim exited with {sim.returncode}")
            time.sleep(0.2)
        time.sleep(0.2)
        urls += json.loads(ports.read_text())["urls"]
    return sims, urls


async def healthy_replicas(session: aiohttp.ClientSession, router: str) -> int:
    async with session.get(f"{router}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith("kvyard_router_healthy_replicas "):
                return int(float(line.split()[1]))
    return 0


async def counts_by_reason(session: aiohttp.ClientSession, router: str) -> dict[str, float]:
    """Index resyncs and ejections so far, by reason (`resyncs:gap`, `ejections:health_check`, ...)."""
    async with session.get(f"{router}/metrics") as response:
        lines = (await response.text()).splitlines()
    counts: dict[str, float] = {}
    for prefix, name in (
        ("kvyard_router_index_resyncs_total{", "resyncs"),
        ("kvyard_router_ejections_total{", "ejections"),
    ):
        for line in lines:
            if line.startswith(prefix):
                reason = line.split('reason="')[1].split('"')[0]
                key = f"{name}:{reason}"
                counts[key] = counts.get(key, 0.0) + float(line.split()[-1])
    return counts


async def decision_times(session: aiohttp.ClientSession, router: str) -> dict[str, float]:
    async with session.get(f"{router}/metrics") as response:
        lines = (await response.text()).splitlines()
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for line in lines:
        if line.startswith("kvyard_router_decision_seconds_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float(bound), float(line.split()[1])))
        elif line.startswith("kvyard_router_decision_seconds_sum"):
            total = float(line.split()[1])
        elif line.startswith("kvyard_router_decision_seconds_count"):
            count = float(line.split()[1])

    def quantile(q: float) -> float:
        return next(bound for bound, seen in buckets if seen >= q * count) * 1e6

    return {
        "decisions": count,
        "decision_us_mean": round(total / max(count, 1) * 1e6, 1),
        "decision_us_p50_at_most": quantile(0.5),
        "decision_us_p99_at_most": quantile(0.99),
    }


async def drive(args: argparse.Namespace, router: str, router_pid: int, num_replicas: int) -> dict[str, Any]:
    rng = random.Random(num_replicas)
    histories = [[rng.randrange(3, 30000) for _ in range(256)] for _ in range(args.sessions)]
    headers = {"Authorization": f"Bearer {ROUTER_ADMIN_KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.monotonic()
        while await healthy_replicas(session, router) < num_replicas:
            if time.monotonic() - started > 300:
                sys.exit("the router did not see every replica healthy within 300 s")
            await asyncio.sleep(0.5)
        ready_s = time.monotonic() - started
        async with session.get(f"{router}/admin/replicas", headers=headers) as response:
            listed = (await response.json())["replicas"]
        synced = sum(1 for replica in listed if replica["kv_events"])
        idle_cpu = cpu_seconds(router_pid)
        await asyncio.sleep(args.idle_s)
        idle_rate = (cpu_seconds(router_pid) - idle_cpu) / args.idle_s
        limit, failures = asyncio.Semaphore(args.concurrency), 0

        async def one(index: int) -> None:
            nonlocal failures
            history = histories[index % len(histories)]
            history += [rng.randrange(3, 30000) for _ in range(32)]
            body = {"prompt": list(history), "max_tokens": 4, "user": f"session-{index % len(histories)}"}
            async with limit, session.post(f"{router}/v1/completions", json=body) as response:
                await response.read()
                failures += response.status != 200

        counts_before = await counts_by_reason(session, router)
        load_cpu, load_started = cpu_seconds(router_pid), time.monotonic()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.monotonic() - load_started
        load_cpu = cpu_seconds(router_pid) - load_cpu
        decisions = await decision_times(session, router)
        counts_after = await counts_by_reason(session, router)
        during_load = {
            key: count - counts_before.get(key, 0.0)
            for key, count in counts_after.items()
            if count > counts_before.get(key, 0.0)
        }
    return {
        "replicas": num_replicas,
        "replicas_with_kv_events": synced,
        "seconds_until_all_healthy": round(ready_s, 1),
        "router_idle_cpu_per_s": round(idle_rate, 3),
        "router_idle_cpu_ms_per_replica_per_s": round(idle_rate / num_replicas * 1e3, 3),
        "requests": args.requests,
        "failed": failures,
        "requests_per_s": round(args.requests / wall, 1),
        "router_cpu_ms_per_request": round((load_cpu - idle_rate * wall) / args.requests * 1e3, 3),
        "router_cpu_ms_per_request_with_idle": round(load_cpu / args.requests * 1e3, 3),
        **decisions,
        "resyncs_and_ejections_during_load": during_load,
    }


def measure(num_replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        sims, urls = start_sims(num_replicas, min(args.sim_processes, num_replicas), Path(scratch))
        port = 18400 + num_replicas % 1000
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvyard",
                "route",
                "--port",
                str(port),
                "--replica-admin-key",
                ADMIN_KEY,
                "--admin-key",
                ROUTER_ADMIN_KEY,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(add_replicas(url, urls))
            result = asyncio.run(drive(args, url, router.pid, num_replicas))
        finally:
            for process in (router, *sims):
                process.terminate()
            for process in (router, *sims):
                process.wait()
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


async def add_replicas(router: str, urls: list[str]) -> None:
    headers = {"Authorization": f"Bearer {ROUTER_ADMIN_KEY}"}
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(f"{router}/openapi.json") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.2)
        for url in urls:
            added = {"url": url, "admin_key": ADMIN_KEY}  # its key: the router follows its KV events
            async with session.post(f"{router}/admin/replicas", json=added, headers=headers) as response:
                response.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="8,100,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--sim-processes", type=int, default=4, help="kvyard sim processes serving the replicas")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds the router's idle CPU is measured")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "router_fleet_live.json")
    args = parser.parse_args()
    rows = [measure(int(size), args) for size in args.replicas.split(",")]
    conditions = {
        "machine": f"{os.cpu_count()} CPUs (shared VM; router, sims and client share them)",
        "sim_processes": args.sim_processes,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "sessions": args.sessions,
        "prompt": "256 tokens + 32 per turn",
        "max_tokens": 4,
        "health_interval_s": 0.5,
        "time_scale": 0.01,
    }
    report = {"benchmark": "router_fleet_live", "conditions": conditions, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""CPU cost of simulated replicas: what `kvyard sim` spends per request, and whether it keeps time.

    .venv/bin/python benchmarks/sim_overhead.py [--replicas 8] [--requests 1000] [--concurrency 32]
        [--prompt-len 2048] [--max-tokens 64] [--stream] [--time-scale 0.05] [--stream-interval-ms 2]

Starts `python -m kvyard sim` with N replicas, sends token-id prompts (half of each from a pool of
32 shared prefixes) round-robin from an aiohttp client in this process, and prints one JSON line:
the sim process's CPU seconds (user + system, from /proc) per request and the replicas' total
`kvyard_sim_lag_seconds` (how far they ran behind their cost model; near 0 means the process kept
up). Nothing here asserts on timings.
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

from kvyard.api.metrics import sample_sum


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(args: argparse.Namespace, urls: list[str], pid: int) -> dict[str, Any]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(30000) for _ in range(args.prompt_len // 2)] for _ in range(32)]
    limit = asyncio.Semaphore(args.concurrency)
    chunks = 0

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal chunks
        tail = [rng.randrange(30000) for _ in range(args.prompt_len - args.prompt_len // 2)]
        body = {"prompt": rng.choice(prefixes) + tail, "max_tokens": args.max_tokens, "stream": args.stream}
        async with limit, session.post(f"{urls[index % len(urls)]}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(await response.text())
            async for line in response.content:
                chunks += line.startswith(b"data: {")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start_cpu, start = cpu_seconds(pid), time.monotonic()
        await asyncio.gather(*(one(session, i) for i in range(args.requests)))
        cpu, wall = cpu_seconds(pid) - start_cpu, time.monotonic() - start
        lag = 0.0
        for url in urls:
            async with session.get(f"{url}/metrics") as response:
                text = await response.text()
            lag += sample_sum(text, "kvyard_sim_lag_seconds")
    return {
        "wall_s": round(wall, 2),
        "requests_per_s": round(args.requests / wall, 1),
        "sim_cpu_s": round(cpu, 2),
        "sim_cpu_ms_per_request": round(cpu / args.requests * 1e3, 2),
        "sse_chunks": chunks,
        "replica_lag_s_total": round(lag, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--stream-interval-ms", type=float, default=2.0)
    parser.add_argument("--tick-ms", type=float, default=2.0)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        ports = Path(scratch) / "ports.json"
        command = [
            sys.executable,
            "-m",
            "kvyard",
            "sim",
            "--port",
            "0",
            "--replicas",
            str(args.replicas),
            "--ports-file",
            str(ports),
            "--time-scale",
            str(args.time_scale),
            "--stream-interval-s",
            str(args.stream_interval_ms / 1000),
            "--tick-s",
            str(args.tick_ms / 1000),
            "--block-size",
            str(args.block_size),
            "--num-kv-blocks",
            "100000",
        ]
        sim = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            while not ports.exists():
                if sim.poll() is not None:
                    sys.exit(f"kvyard sim exited with {sim.returncode}")
                time.sleep(0.1)
            time.sleep(0.2)
            result = asyncio.run(drive(args, json.loads(ports.read_text())["urls"], sim.pid))
        finally:
            sim.terminate()
            sim.wait()
    names = (
        "replicas",
        "requests",
        "concurrency",
        "prompt_len",
        "max_tokens",
        "stream",
        "time_scale",
        "stream_interval_ms",
        "tick_ms",
        "block_size",
    )
    conditions = {name: getattr(args, name) for name in names}
    load = os.getloadavg()[0]
    print(json.dumps({"conditions": {**conditions, "cores": os.cpu_count(), "load_average_1m": load}, **result}))


if __name__ == "__main__":
    main()

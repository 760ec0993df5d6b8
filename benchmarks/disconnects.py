"""Clients that hang up mid-stream: does a replica count every one, and does its memory stay flat?

    .venv/bin/python benchmarks/disconnects.py [--rounds 5] [--per-round 500] [--concurrency 16]
        [--out benchmarks/results/disconnects.json]

One `kvyard serve` of the demo model (memory tier off and a small KV pool, 0.25 GB, so that neither filling
up is taken for growth: the prefix cache keeps an abandoned prompt's blocks, as it keeps any prompt's). Each
round, `--per-round` clients each start a streamed completion of up to 1,000 tokens, read its first bytes and
close the connection, `--concurrency` at a time. After each round (and a second for the aborts to settle): the
server's resident memory (/proc, VmRSS) and its `kvyard_requests_total{outcome="abort"}`. Writes JSON with the
conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvyard.api.metrics import REQUESTS, sample_sum
from kvyard.bench import provenance
from kvyard.testing.model_presets import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.server_utils import start_server  # noqa: E402  (the tests' server starter: one way to start a replica)


def hang_up(port: int, number: int) -> None:
    body = json.dumps(
        {"prompt": f"hang up {number} " * 20, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    ).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall(head.encode() + b"\r\n\r\n" + body)
        connection.recv(1)


def resident_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def aborts(url: str) -> float:
    return sample_sum(httpx.get(f"{url}/metrics", timeout=30).text, f"{REQUESTS}_total", outcome="abort")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=0.25,
        help="the replica's KV pool: small, so that a full pool is told apart from a leak",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "disconnects.json")
    args = parser.parse_args()
    server = start_server(
        DEMO_MODEL_DIR,
        Path(tempfile.mkdtemp(prefix="disconnects-")),
        "--kv-tier",
        "none",
        "--kv-cache-memory-gb",
        str(args.kv_cache_memory_gb),
    )
    rounds: list[dict[str, Any]] = []
    try:
        pid = server.process.pid
        start_kb, start_aborts, sent = resident_kb(pid), aborts(server.url), 0
        print(f"start: {start_kb / 1024:.0f} MB resident", file=sys.stderr, flush=True)
        for number in range(args.rounds):
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda n: hang_up(server.port, n), range(sent, sent + args.per_round)))
            sent += args.per_round
            time.sleep(1.0)
            row = {
                "round": number + 1,
                "disconnects": sent,
                "aborts_counted": aborts(server.url) - start_aborts,
                "resident_mb": resident_kb(pid) / 1024,
            }
            rounds.append(row)
            print(
                f"round {row['round']}: {row['aborts_counted']:.0f} of {sent} counted, "
                f"{row['resident_mb']:.0f} MB resident",
                file=sys.stderr,
                flush=True,
            )
    finally:
        server.stop()
    conditions = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": provenance.host()["cpu"],
        "cores": os.cpu_count(),
        "model": "kvyard demo (fp32)",
        "kv_tier": "none",
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_tokens": 1000,
        "concurrency": args.concurrency,
    }
    result = {
        "benchmark": "disconnects",
        "conditions": conditions,
        "start_resident_mb": start_kb / 1024,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

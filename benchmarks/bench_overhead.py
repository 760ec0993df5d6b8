"""The benchmark client's own overhead: how many requests/s it sustains, and how much TTFT it adds.

A trivial streaming server (`trivial_stream_server.py`, raw asyncio, separate process) answers
every request at once and stamps, on time.monotonic() (one clock for all processes on Linux),
when it had read the request and when it wrote the first chunk. `kvyard bench` runs against it
exactly as a user runs it (subprocess, progress bar on). Per request, joined by prompt:

    client TTFT     = client's first-chunk time - client's start time
    server TTFT     = server's first write      - server's read of the request
    distortion      = client TTFT - server TTFT
                    = (server read - client start) + (client first chunk - server first write)

i.e. everything the client, the kernel's loopback and the trivial server's HTTP parsing add to a
TTFT; the client's share is at most that. Scenarios: closed loop at a few concurrencies (how many
requests/s the client drives), and Poisson open loop at 2,000 req/s (does it keep the schedule,
and what is the distortion at that rate).

    .venv/bin/python benchmarks/bench_overhead.py            # writes results/bench_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_utils import free_port  # noqa: E402

from kvyard.bench import provenance  # noqa: E402
from kvyard.bench.metrics import distribution  # noqa: E402
from kvyard.bench.workloads import LengthRange, TokenSource, random_workload  # noqa: E402

INPUT_LEN, OUTPUT_LEN, VOCAB = 16, 8, 1000


def start_server(port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(ROOT / "benchmarks" / "trivial_stream_server.py"), "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("trivial server did not start")


def run_bench(port: int, seed: int, num_requests: int, work: Path, load_args: list[str]) -> dict[str, Any]:
    out = work / f"run-{seed}.json"
    command = [
        sys.executable,
        "-m",
        "kvyard.cli",
        "bench",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--workload",
        "random",
        "--num-requests",
        str(num_requests),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *load_args,
    ]
    with (work / f"run-{seed}.log").open("wb") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    result: dict[str, Any] = json.loads(out.read_text())
    result["provenance"]["command"] = " ".join(["kvyard", *command[3:]])
    return result


def distortions(result: dict[str, Any], stamps: dict[str, list[float]], seed: int) -> dict[str, list[float]]:
    """Per request: client TTFT, server TTFT, their difference and its two halves (seconds)."""
    workload = random_workload(
        len(result["requests"]),
        LengthRange(INPUT_LEN, INPUT_LEN),
        LengthRange(OUTPUT_LEN, OUTPUT_LEN),
        TokenSource(VOCAB, seed),
    )
    prompts = {}
    for index, session in enumerate(workload.sessions):
        spec = session.next_request(None)
        assert spec is not None
        prompts[index] = str(hash(tuple(spec.prompt)))
    origin = result["summary"]["clock_origin_monotonic"]
    series: dict[str, list[float]] = {"client_ttft": [], "server_ttft": [], "distortion": [], "send": [], "receive": []}
    for record in result["requests"]:
        if record["error"] is not None or not record["token_times"]:
            continue
        read, first = stamps[prompts[record["session"]]]
        start, first_seen = origin + record["start"], origin + record["token_times"][0]
        series["client_ttft"].append(first_seen - start)
        series["server_ttft"].append(first - read)
        series["send"].append(read - start)
        series["receive"].append(first_seen - first)
        series["distortion"].append((first_seen - start) - (first - read))
    return series


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scenario(name: str, result: dict[str, Any], series: dict[str, list[float]], server_cpu: float) -> dict[str, Any]:
    s = result["summary"]

    def ms(values: list[float]) -> dict[str, float] | None:
        dist = distribution(values)
        return None if dist is None else {k: v if k == "count" else v * 1000 for k, v in dist.items()}

    return {
        "scenario": name,
        "command": result["provenance"]["command"],
        "requests": s["requests"],
        "errors": s["errors"],
        "duration_s": s["duration_s"],
        "requests_per_s": s["throughput"]["requests_per_s"],
        "client_ttft_ms": ms(series["client_ttft"]),
        "server_ttft_ms": ms(series["server_ttft"]),
        "ttft_distortion_ms": ms(series["distortion"]),
        "distortion_send_side_ms": ms(series["send"]),
        "distortion_receive_side_ms": ms(series["receive"]),
        "send_lag_ms": ms(_lags(result)),
        # CPU per request: what the pace would be with a core each, whatever else ran on the machine.
        "client_cpu_per_request_ms": s["client_cpu_per_request_ms"],
        "server_cpu_per_request_ms": server_cpu * 1000 / max(1, s["requests"]["total"]),
        "load_average_after": list(os.getloadavg()),
    }


def _lags(result: dict[str, Any]) -> list[float]:
    return [r["start"] - r["scheduled"] for r in result["requests"] if r["scheduled"] is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--closed-requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--open-requests", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_overhead.json")
    args = parser.parse_args()
    port = free_port()
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="kvyard-bench-overhead-") as tmp:
        work = Path(tmp)
        server = start_server(port, work / "server.log")
        scenarios = []
        try:
            plans = [
                (f"closed loop, concurrency {c}", args.closed_requests, ["--concurrency", str(c)])
                for c in args.concurrency
            ]
            plans += [
                (f"Poisson {args.rate:g} req/s", args.open_requests, ["--request-rate", str(args.rate)]),
                ("Poisson 100 req/s (light load)", 1000, ["--request-rate", "100"]),
            ]
            for seed, (name, count, load_args) in enumerate(plans, start=1):
                server_cpu = cpu_seconds(server.pid)
                result = run_bench(port, seed, count, work, load_args)
                server_cpu = cpu_seconds(server.pid) - server_cpu
                stamps = httpx.get(f"http://127.0.0.1:{port}/stamps", timeout=30).json()
                scenarios.append(scenario(name, result, distortions(result, stamps, seed), server_cpu))
                print(_line(scenarios[-1]), flush=True)
        finally:
            server.terminate()
            server.wait()
    report = {
        "what": "kvyard bench's own overhead against a trivial streaming server on loopback",
        "method": (__doc__ or "").split("\n\n")[1],
        "workload": {"input_tokens": INPUT_LEN, "output_tokens": OUTPUT_LEN, "vocab": VOCAB},
        "conditions": {
            "host": provenance.host(),
            "git": provenance.git_state(),
            "load_average_before": load_before,
            "note": "2-core VM shared with other engineers' jobs during the run; client and trivial server unpinned",
            "time": provenance.utc_now(),
        },
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


def _line(s: dict[str, Any]) -> str:
    d, t = s["ttft_distortion_ms"] or {}, s["client_ttft_ms"] or {}
    return (
        f"{s['scenario']}: {s['requests']['completed']}/{s['requests']['total']} ok, "
        f"{s['requests_per_s']:.0f} req/s; client TTFT p50 {t.get('p50', 0):.3f} ms; "
        f"distortion p50 {d.get('p50', 0):.3f} ms, p90 {d.get('p90', 0):.3f} ms, "
        f"p99 {d.get('p99', 0):.3f} ms; CPU per request: client {s['client_cpu_per_request_ms']:.3f} ms, "
        f"server {s['server_cpu_per_request_ms']:.3f} ms"
    )


if __name__ == "__main__":
    main()

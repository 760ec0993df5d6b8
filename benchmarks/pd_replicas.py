"""Prefill/decode disaggregation on real replicas: inter-token latency of running streams while long prompts
arrive, unified vs one prefill + one decode replica, side by side in one run on this machine.

Both fleets get the same two CPU cores and serve the embedded default model (`create_model` llama `bench`
preset, random weights, fp32) through `kvyard route` (cache-aware policy):

- unified: one `kvyard serve` on both cores (OMP_NUM_THREADS=2, `taskset -c 0,1`), once for each step token budget
  of `--unified-budgets` (default: 2048, the engine's default, and 512, smaller prefill chunks: shorter stalls,
  more of them);
- PD: a prefill replica pinned to core 0 and a decode replica pinned to core 1 (OMP_NUM_THREADS=1 each), the
  router with `--prefill` / `--decode` and conditional disaggregation (its default threshold: a request with
  more than 512 prompt tokens to compute on the decode replica is prefilled remotely).

Workload, identical for both: `--streams` greedy streams with short prompts decode for the whole run; after a
warm-up, long prompts (uniform in [`--min-prompt`, `--max-prompt`] tokens, `--long-tokens` output tokens each)
arrive every `--interval-s` seconds. Measured: the inter-token latency (ITL) of the running streams over the
arrival window (p50, p99, p99.9, max), the long prompts' time to first token, and output tokens per second of
everything. The router and this client share the two cores with the replicas in both runs.

    .venv/bin/python benchmarks/pd_replicas.py --out benchmarks/results/pd_replicas.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "pd-benchmark-admin"


@dataclass(slots=True)
class Fleet:
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    router_url: str = ""

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@dataclass(slots=True)
class Observations:
    itl_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def prompt(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 30000) for _ in range(length)]


def spawn(command: list[str], cores: str, threads: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "KVYARD_ADMIN_KEY": ADMIN_KEY}
    with log.open("ab") as sink:
        return subprocess.Popen(["taskset", "-c", cores, *command], stdout=sink, stderr=subprocess.STDOUT, env=env)


def serve(model: Path, port: int, cores: str, threads: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "serve",
        str(model),
        "--port",
        str(port),
        "--kv-tier",
        "none",
        "--admin-key",
        ADMIN_KEY,
        *extra,
    ]
    return spawn(command, cores, threads, log)


def wait_healthy(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


def start_fleet(kind: str, model: Path, logs: Path, base_port: int) -> Fleet:
    """`kind`: "pd", or "unified-<token budget>"."""
    fleet = Fleet()
    router = [sys.executable, "-m", "kvyard", "route", "--port", str(base_port), "--replica-admin-key", ADMIN_KEY]
    if kind.startswith("unified"):
        budget = kind.removeprefix("unified-")
        fleet.processes.append(
            serve(model, base_port + 1, "0,1", 2, logs / f"{kind}.log", "--max-num-batched-tokens", budget)
        )
        router += ["--replica", f"http://127.0.0.1:{base_port + 1}"]
    else:
        fleet.processes.append(serve(model, base_port + 1, "0", 1, logs / f"{kind}-prefill.log", "--role", "prefill"))
        fleet.processes.append(serve(model, base_port + 2, "1", 1, logs / f"{kind}-decode.log", "--role", "decode"))
        router += ["--prefill", f"http://127.0.0.1:{base_port + 1}", "--decode", f"http://127.0.0.1:{base_port + 2}"]
    for port in range(base_port + 1, base_port + len(fleet.processes) + 1):
        wait_healthy(f"http://127.0.0.1:{port}")
    fleet.processes.append(spawn(router, "0,1", 1, logs / f"{kind}-router.log"))
    fleet.router_url = f"http://127.0.0.1:{base_port}"
    wait_healthy(fleet.router_url)
    time.sleep(2)  # the router's first health checks and KV snapshots
    return fleet


def stream(url: str, body: dict[str, Any], until: float, on_token: Any) -> None:
    """One streamed completion; `on_token(t)` at each content chunk, until it ends or the run does."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                on_token(time.monotonic())
            if time.monotonic() > until:
                return


def steady_stream(url: str, index: int, window: tuple[float, float], seen: Observations) -> None:
    body = {"prompt": prompt(index, 64), "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    last: list[float] = []

    def on_token(now: float) -> None:
        if last and window[0] <= now <= window[1]:
            with seen.lock:
                seen.itl_s.append(now - last[0])
        with seen.lock:
            seen.output_tokens += 1
        last[:] = [now]

    try:
        stream(url, body, window[1], on_token)
    except (httpx.HTTPError, RuntimeError) as error:
        seen.failures.append(f"stream {index}: {error}")


def long_request(url: str, index: int, length: int, tokens: int, seen: Observations) -> None:
    sent = time.monotonic()
    first: list[float] = []

    def on_token(now: float) -> None:
        if not first:
            first.append(now)
        with seen.lock:
            seen.output_tokens += 1

    body = {"prompt": prompt(10_000 + index, length), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    try:
        stream(url, body, float("inf"), on_token)
        with seen.lock:
            seen.ttft_s.append(first[0] - sent)
    except (httpx.HTTPError, RuntimeError, IndexError) as error:
        seen.failures.append(f"long {index}: {error}")


def run_workload(url: str, args: argparse.Namespace, lengths: list[int]) -> dict[str, Any]:
    seen = Observations()
    start = time.monotonic()
    window = (start + args.warmup_s, start + args.warmup_s + len(lengths) * args.interval_s)
    threads = [threading.Thread(target=steady_stream, args=(url, i, window, seen)) for i in range(args.streams)]
    for thread in threads:
        thread.start()
    arrivals = []
    for index, length in enumerate(lengths):
        time.sleep(max(0.0, window[0] + index * args.interval_s - time.monotonic()))
        thread = threading.Thread(target=long_request, args=(url, index, length, args.long_tokens, seen))
        thread.start()
        arrivals.append(thread)
    for thread in arrivals:
        thread.join()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    itl = sorted(seen.itl_s)
    itl_ms = {
        "p50": _ms(_pct(itl, 50)),
        "p99": _ms(_pct(itl, 99)),
        "p99.9": _ms(_pct(itl, 99.9)),
        "max": _ms(itl[-1] if itl else 0),
        "mean": _ms(statistics.fmean(itl) if itl else 0),
        "count": len(itl),
    }
    ttft = {
        "p50": round(_pct(sorted(seen.ttft_s), 50), 3),
        "max": round(max(seen.ttft_s, default=0), 3),
        "count": len(seen.ttft_s),
    }
    return {
        "itl_ms": itl_ms,
        "long_ttft_s": ttft,
        "output_tokens_per_s": round(seen.output_tokens / elapsed, 2),
        "failures": seen.failures,
    }


def prometheus_samples(url: str, prefix: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith(prefix)
        for name, value in [line.rsplit(" ", 1)]
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _ratios(pd: dict[str, Any], unified: dict[str, Any]) -> dict[str, float]:
    def ratio(a: float, b: float) -> float:
        return round(a / max(b, 1e-9), 3)

    return {
        "itl_p99": ratio(pd["itl_ms"]["p99"], unified["itl_ms"]["p99"]),
        "itl_p99.9": ratio(pd["itl_ms"]["p99.9"], unified["itl_ms"]["p99.9"]),
        "itl_max": ratio(pd["itl_ms"]["max"], unified["itl_ms"]["max"]),
        "itl_p50": ratio(pd["itl_ms"]["p50"], unified["itl_ms"]["p50"]),
        "long_ttft_p50": ratio(pd["long_ttft_s"]["p50"], unified["long_ttft_s"]["p50"]),
        "output_tokens_per_s": ratio(pd["output_tokens_per_s"], unified["output_tokens_per_s"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--streams", type=int, default=4, help="steady decoding streams (default: 4)")
    parser.add_argument("--arrivals", type=int, default=6, help="long prompts arriving (default: 6)")
    parser.add_argument("--interval-s", type=float, default=12.0, help="seconds between arrivals (default: 12)")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="streams run this long first (default: 8)")
    parser.add_argument("--min-prompt", type=int, default=2048, help="shortest long prompt (default: 2048)")
    parser.add_argument("--max-prompt", type=int, default=7936, help="longest long prompt (default: 7936)")
    parser.add_argument("--long-tokens", type=int, default=16, help="output tokens of each long prompt (default: 16)")
    parser.add_argument(
        "--unified-budgets",
        default="2048,512",
        help="step token budgets (--max-num-batched-tokens) of the unified runs, comma-separated (default: 2048,512)",
    )
    parser.add_argument("--port", type=int, default=18400, help="first port to use (default: 18400)")
    args = parser.parse_args()
    from kvyard.testing.create_model import DEFAULT_ARCH, DEFAULT_PRESET, ensure_default_model

    model = ensure_default_model(DEFAULT_ARCH, DEFAULT_PRESET)
    lengths_rng = random.Random(7)
    lengths = [lengths_rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.arrivals)]
    logs = args.out.parent / "pd_replicas_logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    kinds = [f"unified-{budget.strip()}" for budget in args.unified_budgets.split(",") if budget.strip()] + ["pd"]
    for offset, kind in enumerate(kinds):
        print(f"pd_replicas: starting the {kind} fleet ...", file=sys.stderr, flush=True)
        fleet = start_fleet(kind, model, logs, args.port + 10 * offset)
        try:
            print(f"pd_replicas: {kind}: running the workload ...", file=sys.stderr, flush=True)
            results[kind] = run_workload(fleet.router_url, args, lengths)
            results[kind]["router_pd_paths"] = prometheus_samples(fleet.router_url, "kvyard_router_pd_requests_total")
            if kind == "pd":
                results[kind]["decode_pull_fallbacks"] = prometheus_samples(
                    f"http://127.0.0.1:{args.port + 10 * offset + 2}", "kvyard_kv_transfer_fallbacks_total"
                )
        finally:
            fleet.stop()
        print(f"pd_replicas: {kind}: {json.dumps(results[kind])}", file=sys.stderr, flush=True)
    pd = results["pd"]
    conditions = {
        "model": f"{DEFAULT_ARCH} {DEFAULT_PRESET} preset (random weights), float32, block size 16",
        "hardware": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "unified": "1 replica, OMP_NUM_THREADS=2, taskset -c 0,1; unified-N: --max-num-batched-tokens N",
        "pd": "prefill replica taskset -c 0 + decode replica taskset -c 1, OMP_NUM_THREADS=1 each, "
        "--max-num-batched-tokens 2048 (default); router --disaggregation conditional "
        "(--pd-local-prefill-tokens 512)",
        "prefix caching": "on (no repeated prompts: no hits)",
        "kv tier": "off",
        "speculative decoding": "off",
        "streams": args.streams,
        "stream prompt tokens": 64,
        "long prompts": lengths,
        "long prompt output tokens": args.long_tokens,
        "interval_s": args.interval_s,
    }
    report = {
        "benchmark": "pd_replicas",
        "conditions": conditions,
        "results": results,
        "ratios_pd_over_unified": {kind: _ratios(pd, results[kind]) for kind in kinds if kind != "pd"},
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios_pd_over_unified"]))
    failures = [failure for kind in kinds for failure in results[kind]["failures"]]
    if failures:
        print(f"pd_replicas: {len(failures)} request(s) failed: {failures[:5]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Robustness figures of issue 14, measured on loopback against real `kvyard serve` and `kvyard route`.

A tiny random-weight Llama (kvyard.testing, fp32, CPU) behind one replica and a router in front of it:

1. fuzzing: schemathesis (installed by this script into /opt/kvyard-peers/fuzz, outside the project)
   generates requests from each server's `/openapi.json` (request bodies included) with the
   `not_a_server_error` check; plus a hand-made list of hostile bodies (lone surrogates, deep nesting,
   huge integers, 64-bit overflowing seeds, coerced types, streaming variants), each sent to both servers.
   Counted: responses >= 500 and dropped connections. The greedy answer to a fixed prompt is compared
   before and after.
2. `/health` latency while 4 clients keep sending 5 MB bodies (refused with 413) and while 4 clients send
   3.5 MB prompts (under the limit: tokenized off the event loop), probed every 20 ms.
3. rate limit: a replica with `--requests-per-min 600` (10/s, 10 s burst) gets 30 completions/s for 20 s;
   accepted over what the configured rate and burst allow.

A schemathesis "Runtime Error" is the fuzzer failing to generate a case (reported in its summary), not a
response; responses are counted from its NDJSON event stream.

    .venv/bin/python benchmarks/robustness.py --out benchmarks/results/robustness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvyard.testing.create_model import create_model  # noqa: E402
from tests.router_utils import start_router  # noqa: E402
from tests.server_utils import ServerProcess, start_server  # noqa: E402

FUZZ_VENV = Path("/opt/kvyard-peers/fuzz")
GREEDY = {"prompt": "The lighthouse keeper", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
HOSTILE: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x", "model": "\\udfff"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "x", "a": ' + b"[" * 1100 + b"]" * 1100 + b"}"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}'),
    ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616, "stream": true}'),
    ("/v1/completions", b'{"prompt": "x", "seed": 9223372036854775807, "n": 2, "stream": true}'),
    ("/v1/completions", b'{"prompt": [0, 1, "2"]}'),
    ("/v1/completions", b'{"prompt": [[false]]}'),
    ("/v1/completions", b'{"prompt": "x", "n": true}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000000, "stream": true}'),
    ("/v1/completions", json.dumps({"prompt": [[1, 2]] * 100, "n": 16}).encode()),
    ("/v1/completions", b"not json"),
    ("/v1/completions", b"[]"),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}], "stream": true}'),
    ("/detokenize", b'{"tokens": [-1]}'),
]


def ensure_schemathesis() -> Path:
    st = FUZZ_VENV / "bin" / "st"
    if not st.exists():
        print(f"installing schemathesis into {FUZZ_VENV} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(FUZZ_VENV)], check=True)
        subprocess.run([str(FUZZ_VENV / "bin" / "pip"), "install", "schemathesis"], check=True)
    return st


def run_schemathesis(st: Path, url: str, max_examples: int, report_dir: Path) -> dict[str, Any]:
    report = report_dir / f"st-{url.rsplit(':', 1)[1]}.json"
    command = [
        str(st),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(max_examples),
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(report),
        "--seed",
        "1",
        "--workers",
        "2",
        "--request-timeout",
        "60",
        "--phases",
        "examples,coverage,fuzzing",
    ]
    started = time.monotonic()
    completed = subprocess.run(command, capture_output=True, text=True)
    lines = completed.stdout.strip().splitlines()
    tail = [
        line
        for line in lines
        if line.strip() and ("passed" in line or "fail" in line or "Error" in line or "error" in line)
    ][-8:]
    return {
        "exit_code": completed.returncode,
        "seconds": round(time.monotonic() - started, 1),
        **_ndjson_counts(report),
        "summary": tail,
    }


def _ndjson_counts(report: Path) -> dict[str, int]:
    """Requests sent and responses >= 500, from schemathesis's event stream."""
    sent = server_errors = 0
    if not report.exists():
        return {"requests": 0, "server_errors": -1}
    for line in report.read_text().splitlines():
        for status in _statuses(json.loads(line)):
            sent += 1
            server_errors += status >= 500
    return {"requests": sent, "server_errors": server_errors}


def _statuses(event: Any) -> list[int]:
    found: list[int] = []
    if isinstance(event, dict):
        for key, value in event.items():
            if key == "status_code" and isinstance(value, int):
                found.append(value)
            else:
                found += _statuses(value)
    elif isinstance(event, list):
        for item in event:
            found += _statuses(item)
    return found


def send_hostile(url: str) -> dict[str, Any]:
    statuses, dropped = [], 0
    for path, body in HOSTILE:
        try:
            with httpx.stream(
                "POST", f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60
            ) as response:
                text = b"".join(response.iter_bytes())
                if response.status_code == 200 and b"[DONE]" not in text and b'"error"' not in text:
                    dropped += response.headers.get("content-type", "").startswith("text/event-stream")
                statuses.append(response.status_code)
        except httpx.TransportError:
            dropped += 1
    return {
        "sent": len(HOSTILE),
        "server_errors": sum(s >= 500 for s in statuses),
        "dropped": dropped,
        "statuses": sorted(set(statuses)),
    }


def greedy_text(url: str) -> str:
    return str(httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=120).json()["choices"][0]["text"])


async def health_under_load(url: str, body: bytes, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    answers: dict[int, int] = {}
    stop = time.monotonic() + seconds

    async def sender(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            try:
                response = await client.post(
                    f"{url}/tokenize", content=body, headers={"content-type": "application/json"}
                )
                answers[response.status_code] = answers.get(response.status_code, 0) + 1
            except httpx.TransportError:
                answers[-1] = answers.get(-1, 0) + 1

    async def prober(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            started = time.perf_counter()
            await client.get(f"{url}/health")
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)

    async with httpx.AsyncClient(timeout=120) as big, httpx.AsyncClient(timeout=10) as small:
        await asyncio.gather(prober(small), *(sender(big) for _ in range(4)))
    ordered = sorted(latencies)
    return {
        "probes": len(ordered),
        "health_p50_ms": 1e3 * statistics.median(ordered),
        "health_p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        "health_max_ms": 1e3 * ordered[-1],
        "big_body_answers": answers,
    }


async def rate_limited(url: str, per_s: float, seconds: float, configured_per_min: float) -> dict[str, Any]:
    counts: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        started = time.monotonic()
        tasks = []
        for index in range(int(per_s * seconds)):
            await asyncio.sleep(max(0.0, started + index / per_s - time.monotonic()))
            body = {"prompt": [1, 2, 3], "max_tokens": 1}
            tasks.append(asyncio.create_task(client.post(f"{url}/v1/completions", json=body)))
        for response in await asyncio.gather(*tasks):
            counts[response.status_code] = counts.get(response.status_code, 0) + 1
        elapsed = time.monotonic() - started
    burst = configured_per_min / 60 * 10
    allowed = burst + configured_per_min / 60 * elapsed
    return {
        "offered_per_s": per_s,
        "seconds": round(elapsed, 2),
        "answers": counts,
        "configured_per_min": configured_per_min,
        "burst": burst,
        "accepted_over_allowed": counts.get(200, 0) / allowed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=100, help="schemathesis examples per operation (100)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each /health phase (10)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/robustness.json")
    args = parser.parse_args()
    st = ensure_schemathesis()
    result: dict[str, Any] = {
        "conditions": {
            "model": "tiny random-weight llama (kvyard.testing)",
            "dtype": "float32",
            "device": "cpu (2 cores)",
            "max_body_mb": 4,
            "schemathesis_max_examples": args.max_examples,
        }
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        model = create_model("llama", "tiny", work / "llama")
        replica: ServerProcess = start_server(model, work)
        router = start_router(work, [replica.url])
        servers = {"serve": replica.url, "route": router.url}
        try:
            before = greedy_text(replica.url)
            for name, url in servers.items():
                print(f"fuzzing {name} ...", flush=True)
                result[f"schemathesis_{name}"] = run_schemathesis(st, url, args.max_examples, work)
                result[f"hostile_{name}"] = send_hostile(url)
            result["greedy_identical_after"] = greedy_text(replica.url) == before == greedy_text(router.url)
            print("/health while big bodies arrive ...", flush=True)
            refused = json.dumps({"prompt": "x " * (5 << 19)}).encode()  # 5 MiB: over the limit
            admitted = json.dumps({"prompt": "word " * 700_000}).encode()  # 3.5 MB: under the limit, tokenized
            result["health_5mb_refused"] = asyncio.run(health_under_load(replica.url, refused, args.seconds))
            result["health_3_5mb_tokenized"] = asyncio.run(health_under_load(replica.url, admitted, args.seconds))
        finally:
            router.stop()
            replica.stop()
        print("rate limit ...", flush=True)
        limited = start_server(model, work, "--requests-per-min", "600")
        try:
            result["rate_limit"] = asyncio.run(rate_limited(limited.url, 30.0, 20.0, 600.0))
        finally:
            limited.stop()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

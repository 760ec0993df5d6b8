"""Real vLLM servers (vLLM's CPU build, from the `.venv-vllm` that `scripts/setup.sh --vllm` makes) on loopback,
publishing their KV events over ZMQ, for the tests and benchmarks that put `kvyard route` in front of vLLM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VLLM_PYTHON_ENV = "KVYARD_VLLM_PYTHON"  # another vLLM install's python, instead of the repository's .venv-vllm
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32


def vllm_python() -> Path | None:
    """The python of an environment with vLLM: $KVYARD_VLLM_PYTHON, else the repository's .venv-vllm."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    if configured:
        return Path(configured)
    candidate = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class VllmReplica:
    """One `vllm.entrypoints.openai.api_server` process."""

    process: subprocess.Popen[bytes]
    port: int
    events_port: int | None
    replay_port: int | None
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str | None:
        """The endpoint(s) to give `kvyard route --replica-events`."""
        if self.events_port is None:
            return None
        publisher = f"tcp://127.0.0.1:{self.events_port}"
        return publisher if self.replay_port is None else f"{publisher},tcp://127.0.0.1:{self.replay_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 30 s; the engine core is in the server's process group and goes with it."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """As a crash: SIGKILL to the server and its engine core at once."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def start_vllm(
    model_dir: Path,
    log_dir: Path,
    *,
    served_name: str,
    port: int | None = None,
    events_port: int | None = None,
    replay_port: int | None = None,
    events: bool = True,
    replay: bool = True,
    cpus: str = "auto",
    kv_cache_gb: int = 1,
    extra: tuple[str, ...] = (),
    environment: dict[str, str] | None = None,
    taskset: str | None = None,
) -> VllmReplica:
    """Start a vLLM server (returns at once; `wait_ready` waits). `cpus` is VLLM_CPU_OMP_THREADS_BIND ("0", "1",
    "0-1", "auto"); KV events, when on, go to a PUB socket on `events_port` and a replay socket on `replay_port`;
    `environment` adds variables (VLLM_SERVER_DEV_MODE=1 serves /reset_prefix_cache); `taskset`: a CPU list the
    whole process tree is bound to."""
    python = vllm_python()
    if python is None:
        raise FileNotFoundError("no vLLM here: run `bash scripts/setup.sh --vllm` (or set $KVYARD_VLLM_PYTHON)")
    port = port or free_port()
    events_port = (events_port or free_port()) if events else None
    replay_port = (replay_port or free_port()) if events and replay else None
    command = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(VLLM_BLOCK_SIZE),
        "--enable-prompt-tokens-details",
        "--max-num-seqs",
        "32",
        "--uvicorn-log-level",
        "warning",
    ]
    if events_port is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
        if replay_port is not None:
            config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
        command += ["--kv-events-config", json.dumps(config)]
    variables = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        **(environment or {}),
    }
    openmp = python.parent.parent / "lib" / "libiomp5.so"  # vLLM's CPU build runs on Intel's OpenMP
    if openmp.exists():
        variables["LD_PRELOAD"] = str(openmp)
    log_path = log_dir / f"vllm-{port}.log"
    with log_path.open("wb") as log:
        bound = ["taskset", "-c", taskset] if taskset is not None else []
        process = subprocess.Popen(
            [*bound, *command, *extra], stdout=log, stderr=subprocess.STDOUT, env=variables, start_new_session=True
        )
    return VllmReplica(process, port, events_port, replay_port, log_path)


def wait_ready(replicas: list[VllmReplica], timeout: float = 420.0) -> None:
    """Wait until every replica answers /health (vLLM's CPU build takes about a minute on two cores)."""
    deadline = time.monotonic() + timeout
    pending = list(replicas)
    while pending:
        pending = [replica for replica in pending if not replica.healthy()]
        if pending and time.monotonic() > deadline:
            for replica in replicas:
                replica.stop()
            raise TimeoutError(f"vLLM not ready in {timeout:.0f} s:\n{pending[0].log()[-4000:]}")
        time.sleep(0.5)

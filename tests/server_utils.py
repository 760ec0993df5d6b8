"""Start real `kvyard serve` processes on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvyard.api.metrics import MODEL_NAME
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}  # the admin key every test server and router gets


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    model_dir: Path, log_dir: Path, *extra: str, timeout: float = 120.0, port: int | None = None
) -> ServerProcess:
    port = port or free_port()
    log_path = log_dir / f"server-{port}.log"
    if "--admin-key" not in extra:
        extra = (*extra, "--admin-key", TEST_ADMIN_KEY)
    if "--kv-tier" not in extra and "--kv-disk-dir" not in extra:
        # The default disk tier persists across runs; keep each test server's blocks to itself.
        extra = (*extra, "--kv-disk-dir", str(log_dir / f"kv-blocks-{port}"))
    command = [sys.executable, "-m", "kvyard.cli", "serve", str(model_dir), "--port", str(port), *extra]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{server.log()}")


def metric_value(metrics_text: str, name: str) -> float:
    """The value of sample `name` in Prometheus text format, summed over its label sets (a replica's carry only
    the name of the model it serves)."""
    values = [
        float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith((name + " ", name + "{"))
    ]
    if not values:
        raise KeyError(name)
    return sum(values)


def model_names(metrics_text: str) -> dict[str, set[str | None]]:
    """The `model_name` labels of each kvyard_ sample name of a replica's /metrics (None: a sample without one)."""
    names: dict[str, set[str | None]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.startswith("kvyard_"):
                names.setdefault(sample.name, set()).add(sample.labels.get(MODEL_NAME))
    return names

"""Start a real redis-server on a free loopback port for tests (installed by scripts/setup.sh)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from server_utils import free_port


@dataclass
class RedisProcess:
    process: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_redis(directory: Path, port: int | None = None) -> RedisProcess:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; run scripts/setup.sh")
    port = port or free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(directory)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisProcess(process, port, directory)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")

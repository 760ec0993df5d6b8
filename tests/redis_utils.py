"""Start a real redis-server on a free loopback port for tests (installed by scripts/setup.sh)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis
from server_utils import free_port


@dataclass(frozen=True)
class RedisTLS:
    """A server that speaks only TLS (with `cert_file`, signed by `ca_file`) and requires `password`."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    password: str

    def server_args(self, port: int) -> tuple[str, ...]:
        return (
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(self.cert_file),
            "--tls-key-file",
            str(self.key_file),
            "--tls-ca-cert-file",
            str(self.ca_file),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            self.password,
        )


@dataclass
class RedisProcess:
    process: subprocess.Popen[bytes]
    port: int
    directory: Path
    tls: RedisTLS | None = None

    @property
    def url(self) -> str:
        if self.tls is None:
            return f"redis://127.0.0.1:{self.port}/0"
        return self.tls_url()

    def tls_url(self, password: str | None = None, ca_file: Path | None = None) -> str:
        """The URL of this TLS server, with another password or CA file where given."""
        assert self.tls is not None
        password = quote(self.tls.password if password is None else password, safe="")
        ca_file = quote(str(ca_file or self.tls.ca_file))
        return f"rediss://:{password}@127.0.0.1:{self.port}/0?ssl_ca_certs={ca_file}"

    def client(self) -> redis.Redis:
        if self.tls is None:
            return redis.Redis(host="127.0.0.1", port=self.port)
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.tls.password, ssl=True, ssl_ca_certs=str(self.tls.ca_file)
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# A cluster node also listens on its port + 10000, so its own port must leave room for that.
CLUSTER_MAX_PORT = 55535


def start_redis(
    directory: Path,
    port: int | None = None,
    extra: tuple[str, ...] = (),
    max_port: int = 65535,
    tls: RedisTLS | None = None,
) -> RedisProcess:
    """redis-server on `port` (default: a free one up to max_port, retried if another process takes it first);
    with `tls`, `port` is its TLS port and the plain port is off."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; run scripts/setup.sh")
    for _ in range(3):
        server = _launch(binary, directory, port or _free_port_up_to(max_port), extra, tls)
        if server is not None:
            return server
    raise RuntimeError(f"redis-server did not start; see {directory}/redis-*.log")


def _free_port_up_to(max_port: int) -> int:
    while (port := free_port()) > max_port:
        pass
    return port


def _launch(
    binary: str, directory: Path, port: int, extra: tuple[str, ...], tls: RedisTLS | None
) -> RedisProcess | None:
    listen = ("--port", str(port)) if tls is None else tls.server_args(port)
    command = [
        binary,
        *listen,
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
        *extra,
    ]
    with (directory / f"redis-{port}.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    server = RedisProcess(process, port, directory, tls)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    return None


def start_redis_cluster(directory: Path, num_nodes: int = 3) -> list[RedisProcess]:
    """A real Redis Cluster of `num_nodes` masters on loopback (no replicas)."""
    nodes: list[RedisProcess] = []
    try:
        for index in range(num_nodes):
            node_dir = directory / f"node{index}"
            node_dir.mkdir()
            nodes.append(start_redis(node_dir, extra=("--cluster-enabled", "yes"), max_port=CLUSTER_MAX_PORT))
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(_cluster_ready(node) for node in nodes):  # every node must see every slot served
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not become ready")
            time.sleep(0.1)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


def _cluster_ready(node: RedisProcess) -> bool:
    info = node.client().cluster("info")
    return bool(info.get("cluster_state") == "ok" and int(info.get("cluster_slots_ok", 0)) == 16384)

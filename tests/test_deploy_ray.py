"""`kvyard deploy` on a real local Ray cluster: a head and two worker nodes with their own resources, started by
`ray start` processes the tests own. Fleets of tiny-Llama replicas and routers are deployed, served through,
broken (actor processes killed) and scaled with the command a user runs."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from router_utils import wait_for
from server_utils import free_port, start_server

from kvyard.deploy.ray_cluster import head_command
from kvyard.deploy.spec import parse_spec

RAY = str(Path(sys.executable).parent / "ray")
WORKER_RESOURCES = ({"replica_slot": 2, "node_a": 1}, {"replica_slot": 2, "node_b": 1})


@dataclass
class RayCluster:
    address: str
    nodes: list[subprocess.Popen[bytes]]

    def deploy(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvyard", "deploy", *args, "--address", self.address],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def kill_actor(self, name: str, namespace: str) -> None:
        """Kill a named actor's process as a crash would (Ray may restart it)."""
        code = (
            f"import ray; ray.init(address={self.address!r}, logging_level=40, log_to_driver=False); "
            f"ray.kill(ray.get_actor({name!r}, namespace={namespace!r}), no_restart=False)"
        )
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)

    def status(self, name: str) -> dict[str, Any]:
        result = self.deploy("--name", name, "--status", "--json", timeout=60)
        assert result.returncode == 0, result.stderr
        status: dict[str, Any] = json.loads(result.stdout)
        return status


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    common = ["--block", "--disable-usage-stats"]
    head = _start_node(
        [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
            *common,
        ]
    )
    nodes = [head]
    try:
        _wait_for_nodes(port, 1)
        # One at a time, each on ports of its own: nodes on one machine would otherwise race for the same ones.
        for number, resources in enumerate(WORKER_RESOURCES, start=2):
            nodes.append(
                _start_node(
                    [
                        RAY,
                        "start",
                        f"--address=127.0.0.1:{port}",
                        "--num-cpus=2",
                        f"--resources={json.dumps(resources)}",
                        *_own_ports(),
                        *common,
                    ]
                )
            )
            _wait_for_nodes(port, number)
        yield RayCluster(f"127.0.0.1:{port}", nodes)
    finally:
        for node in reversed(nodes):  # workers first, the head last
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _own_ports() -> list[str]:
    flags = (
        "--node-manager-port",
        "--object-manager-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
    )
    return [f"{flag}={free_port()}" for flag in flags]


def _start_node(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_for_nodes(port: int, count: int, timeout_s: float = 120) -> None:
    probe = (
        f"import ray; ray.init(address='127.0.0.1:{port}', logging_level=40, log_to_driver=False); "
        "print('alive nodes:', sum(node['Alive'] for node in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        alive = re.search(r"^alive nodes: (\d+)$", result.stdout, re.MULTILINE)
        if alive is not None and int(alive.group(1)) >= count:
            return
        time.sleep(1)
    raise AssertionError(f"the Ray cluster did not reach {count} nodes")


def write_spec(
    path: Path,
    name: str,
    model: Path,
    roles: dict[str, int],
    routers: int = 1,
    external: list[dict[str, str]] | None = None,
    role_fields: dict[str, dict[str, Any]] | None = None,
    ray: dict[str, Any] | None = None,
) -> Path:
    spec: dict[str, Any] = {
        "name": name,
        "model": str(model),
        "roles": {
            role: {
                "replicas": count,
                "num_cpus": 1,
                "resources": {"replica_slot": 1},
                **(role_fields or {}).get(role, {}),
            }
            for role, count in roles.items()
        },
        "router": {"replicas": routers, "port": _free_port_pair(), "num_cpus": 0},
        "ready_timeout_s": 240,
    }
    if external:
        spec["external_replicas"] = external
    if ray:
        spec["ray"] = ray
    path.write_text(yaml.safe_dump(spec))
    return path


def _free_port_pair() -> int:
    """A port whose next one is free too (router i listens on port + i)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port


def members(status: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [member for member in status["members"] if member["role"] == role]


def router_urls(status: dict[str, Any]) -> list[str]:
    return [member["url"] for member in members(status, "router")]


def complete(router_url: str, prompt: str, max_tokens: int = 24) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{router_url}/v1/completions", json=body, timeout=120)


def routed_replicas(router_url: str) -> int:
    """Healthy replicas as the router's own metrics count them (no admin key needed)."""
    try:
        text = httpx.get(f"{router_url}/metrics", timeout=10).text
    except httpx.HTTPError:  # a router restarting
        return 0
    for line in text.splitlines():
        if line.startswith("kvyard_router_healthy_replicas "):
            return int(float(line.split()[1]))
    return 0


class Load:
    """Non-streaming completions sent one after another from `threads` threads until stopped."""

    def __init__(self, router_url: str, threads: int = 3) -> None:
        self.router_url = router_url
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run, index) for index in range(threads)]

    def _run(self, index: int) -> None:
        turn = 0
        while not self._stop.is_set():
            try:
                self.statuses.append(complete(self.router_url, f"load {index} turn {turn}", 32).status_code)
            except httpx.HTTPError as error:
                self.errors.append(repr(error))
            turn += 1

    def stop(self) -> None:
        self._stop.set()
        for future in self._futures:
            future.result()
        self._pool.shutdown()


def processes_alive(status: dict[str, Any]) -> list[int]:
    pids = [pid for member in status["members"] for pid in (member.get("actor_pid"), member.get("pid")) if pid]
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_a_fleet_serves_survives_a_killed_replica_scales_and_goes_down(
    ray_cluster: RayCluster, llama_dir: Path, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "fleet.yaml", "t-unified", llama_dir, {"unified": 2})
    deployed = ray_cluster.deploy(str(spec))
    assert deployed.returncode == 0, deployed.stderr
    status = ray_cluster.status("t-unified")
    replicas = members(status, "unified")
    assert [m["reachable"] for m in replicas] == [True, True]
    assert len({m["node_id"] for m in replicas}) == 2, "spread: one replica per worker node"
    router = router_urls(status)[0]
    answers = {complete(router, "the same prompt").json()["choices"][0]["text"] for _ in range(4)}
    assert len(answers) == 1  # greedy: the same text from whichever replica served it

    # A replica actor's process is killed under load: requests not yet streaming are retried on the other
    # replica, Ray restarts the actor (a new server, on a new port), and the router re-admits it.
    load = Load(router)
    time.sleep(2)
    victim = replicas[0]
    os.kill(victim["actor_pid"], signal.SIGKILL)
    wait_for(lambda: _restarted(ray_cluster.status("t-unified"), victim), 180, "the killed replica to restart")
    wait_for(lambda: routed_replicas(router) == 2, 60, "the router to route to both replicas")
    time.sleep(2)
    load.stop()
    assert load.errors == [] and set(load.statuses) == {200}, (load.errors, set(load.statuses))
    assert len(load.statuses) > 10
    listed = ray_cluster.status("t-unified")["routers"][router]
    assert len(listed) == 2, listed  # the dead server's old URL is gone from the router's list

    # Scale up: the router uses the new replica at once; scale down under load: drained, nothing lost.
    up = ray_cluster.deploy(str(spec), "--scale", "unified=3")
    assert up.returncode == 0, up.stderr
    assert routed_replicas(router) == 3
    load = Load(router)
    time.sleep(1)
    down = ray_cluster.deploy(str(spec), "--scale", "unified=1")
    load.stop()
    assert down.returncode == 0, down.stderr
    assert load.errors == [] and set(load.statuses) == {200}, (load.errors, set(load.statuses))
    status = ray_cluster.status("t-unified")
    assert [m["name"] for m in members(status, "unified")] == ["replica-unified-0"]
    assert len(status["routers"][router]) == 1

    # The controller's process dies: Ray restarts it, it adopts the running actors (the scaled count, not the
    # spec's) and keeps the router current; nothing it owns was restarted.
    ray_cluster.kill_actor("controller", "kvyard-t-unified")
    wait_for(lambda: _answers_status(ray_cluster, "t-unified"), 120, "the restarted controller to answer")
    restarted = ray_cluster.status("t-unified")
    assert restarted["desired"] == {"unified": 1, "prefill": 0, "decode": 0, "router": 1}, restarted["desired"]
    assert [(m["name"], m["actor_pid"]) for m in restarted["members"]] == [
        (m["name"], m["actor_pid"]) for m in status["members"]
    ]
    assert complete(router, "after the controller restarted").status_code == 200

    # Down: every process of the fleet is gone.
    before = ray_cluster.status("t-unified")
    stopped = ray_cluster.deploy(str(spec), "--down")
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not processes_alive(before), 30, "the fleet's processes to exit")
    gone = ray_cluster.deploy("--name", "t-unified", "--status", timeout=60)
    assert gone.returncode == 1 and "no fleet named 't-unified'" in gone.stderr


def _answers_status(cluster: RayCluster, name: str) -> bool:
    return cluster.deploy("--name", name, "--status", "--json", timeout=60).returncode == 0


def _restarted(status: dict[str, Any], victim: dict[str, Any]) -> bool:
    now = next(m for m in status["members"] if m["name"] == victim["name"])
    return bool(now["reachable"] and now["actor_pid"] != victim["actor_pid"])


def test_two_routers_over_one_fleet_one_killed_under_load(
    ray_cluster: RayCluster, llama_dir: Path, tmp_path: Path
) -> None:
    """Also a replica the fleet does not run (`external_replicas`, as a vLLM server would be): every router routes
    to it, with the KV-event endpoint the spec gives, and the controller never removes it."""
    outside = start_server(llama_dir, tmp_path)
    events = "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"
    spec = write_spec(
        tmp_path / "fleet.yaml",
        "t-ha",
        llama_dir,
        {"unified": 1},
        routers=2,
        external=[{"url": outside.url, "events": events}],
    )
    deployed = ray_cluster.deploy(str(spec))
    assert deployed.returncode == 0, deployed.stderr
    try:
        status = ray_cluster.status("t-ha")
        first, second = members(status, "router")
        for router in (first, second):
            wait_for(lambda url=router["url"]: routed_replicas(url) == 2, 60, "the routers to route to both")
        for view in ray_cluster.status("t-ha")["routers"].values():
            assert view[outside.url]["kv_events_endpoint"] == events and view[outside.url]["kind"] == "kvyard"
        load = Load(second["url"])
        time.sleep(2)
        os.kill(first["actor_pid"], signal.SIGKILL)
        time.sleep(3)
        load.stop()
        assert load.errors == [] and set(load.statuses) == {200}, (load.errors, set(load.statuses))
        # Ray restarts the killed router on its port; the controller gives it the fleet's replicas again.
        wait_for(lambda: routed_replicas(first["url"]) == 2, 120, "the restarted router's replica list")
        assert complete(first["url"], "after the restart").status_code == 200
    finally:
        assert ray_cluster.deploy(str(spec), "--down").returncode == 0
        assert outside.process.poll() is None, "a replica the fleet does not run outlives it"
        outside.stop()


def test_a_disaggregated_fleet(ray_cluster: RayCluster, llama_dir: Path, tmp_path: Path) -> None:
    """Also: a spec's `ray` ports are for a cluster kvyard deploy starts; this one runs already, and keeps its own."""
    first = _free_port_pair()  # a range of two free ports, for the decode replica on loopback
    spec = write_spec(
        tmp_path / "fleet.yaml",
        "t-pd",
        llama_dir,
        {"prefill": 1, "decode": 1},
        role_fields={"decode": {"host": "127.0.0.1", "ports": f"{first}-{first + 1}"}},
        ray={"port": 6390, "worker_ports": "20000-20999"},
    )
    deployed = ray_cluster.deploy(str(spec))
    assert deployed.returncode == 0, deployed.stderr
    assert "the spec's ray section (ray.port, ray.worker_ports) is ignored" in deployed.stderr, deployed.stderr
    try:
        status = ray_cluster.status("t-pd")
        decode_url = members(status, "decode")[0]["url"]
        assert decode_url in (f"http://127.0.0.1:{first}", f"http://127.0.0.1:{first + 1}"), decode_url
        router = router_urls(status)[0]
        roles = {view["role"] for view in status["routers"][router].values()}
        assert roles == {"prefill", "decode"}
        # Above the router's local-prefill threshold, and new: replicas' disk tiers outlive test runs.
        long_prompt = uuid.uuid4().hex + " ".join(f"word{i}" for i in range(250))
        answer = complete(router, long_prompt, 8)
        assert answer.status_code == 200, answer.text
        metrics = httpx.get(f"{router}/metrics", timeout=10).text
        pd_lines = [line for line in metrics.splitlines() if line.startswith("kvyard_router_pd_requests_total")]
        assert pd_lines == ['kvyard_router_pd_requests_total{path="remote"} 1.0'], (pd_lines, answer.json(), status)
    finally:
        assert ray_cluster.deploy(str(spec), "--down").returncode == 0


def test_the_head_kvyard_starts_listens_on_the_spec_ray_ports() -> None:
    """The `ray start --head` kvyard deploy runs when no cluster runs, from a spec's `ray` section: the node takes
    the address given, Ray listens on each port given, and its worker processes (this probe's driver) take ports
    from the range. Run here with --block, a temp dir and a process group of its own, so it stops with the test
    and leaves alone the other Ray clusters of the machine (`ray stop` would stop them all)."""
    import ray

    names = (
        "port",
        "node_manager_port",
        "object_manager_port",
        "metrics_export_port",
        "runtime_env_agent_port",
        "dashboard_agent_listen_port",
        "dashboard_agent_grpc_port",
    )
    ports = dict(zip(names, _distinct_free_ports(len(names)), strict=True))
    first = _free_port_range(8)
    address = ray.util.get_node_ip_address()  # the one Ray would take (a spec names one where a machine has several)
    section = {"node_ip_address": address, **ports, "worker_ports": f"{first}-{first + 7}"}
    spec = parse_spec({"model": "demo", "roles": {"unified": {"replicas": 1}}, "ray": section})
    temp_dir = tempfile.mkdtemp(prefix="kvh", dir="/tmp")
    head = _start_node([*head_command(spec.ray), "--num-cpus=1", f"--temp-dir={temp_dir}", "--block"])
    try:
        _wait_for_nodes(ports["port"], 1)
        # Ray's minimal install (`ray`, what kvyard[fleet] asks for) runs its dashboard agent without the HTTP, gRPC
        # and metrics servers; `ray[default]` runs them.
        agent = ("metrics_export_port", "dashboard_agent_listen_port", "dashboard_agent_grpc_port")
        full_agent = ray._private.utils.get_dashboard_dependency_error() is None
        listened = [port for name, port in ports.items() if full_agent or name not in agent]
        probe = [sys.executable, "-c", _PORTS_PROBE, f"127.0.0.1:{ports['port']}", json.dumps(listened)]
        result = subprocess.run(probe, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        node = json.loads(result.stdout.splitlines()[-1])
        assert node["NodeManagerAddress"] == address
        assert (node["NodeManagerPort"], node["ObjectManagerPort"], node["MetricsExportPort"]) == (
            ports["node_manager_port"],
            ports["object_manager_port"],
            ports["metrics_export_port"],
        )
        assert set(listened) <= set(node["listening"]), (ports, node["listening"])
        assert any(first <= port <= first + 7 for port in node["listening"]), "the driver's worker port"
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


# Connects (a driver, which takes a worker port), waits up to 60 s for the ports of argv[2] to listen (Ray's agents
# start after the node), then prints the node as Ray lists it and the TCP ports anything listens on (LISTEN: 0A).
_PORTS_PROBE = """
import json, sys, time, ray
def listening():
    tables = [open(name).readlines()[1:] for name in ("/proc/net/tcp", "/proc/net/tcp6")]
    return {int(row.split()[1].rsplit(":", 1)[1], 16) for table in tables for row in table if row.split()[3] == "0A"}
ray.init(address=sys.argv[1], logging_level=40, log_to_driver=False)
deadline = time.monotonic() + 60
while not set(json.loads(sys.argv[2])) <= listening() and time.monotonic() < deadline:
    time.sleep(0.5)
print(json.dumps({**ray.nodes()[0], "listening": sorted(listening())}, default=str))
"""


def _distinct_free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def _free_port_range(size: int) -> int:
    """The first of `size` consecutive free ports, below the kernel's ephemeral range (where free_port's lie)."""
    while True:
        first = random.randrange(20000, 30000 - size)
        try:
            for port in range(first, first + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first

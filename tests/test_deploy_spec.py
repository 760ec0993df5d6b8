"""The fleet spec of `kvyard deploy`: what it accepts, and errors that name the field."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvyard.deploy.process import ProcessFailed, free_port
from kvyard.deploy.ray_cluster import head_command, ray_client_installed
from kvyard.deploy.spec import FleetSpec, RaySpec, SpecError, load_spec, parse_spec

EXAMPLE = Path(__file__).parent.parent / "examples" / "fleet.yaml"
PORTS_EXAMPLE = Path(__file__).parent.parent / "examples" / "fleet-ports.yaml"


def _with_ray(section: Any, **top: Any) -> dict[str, Any]:
    """A one-replica fleet with this `ray` section (and other top-level fields)."""
    return {"model": "demo", "roles": {"unified": {"replicas": 1}}, "ray": section, **top}


def test_the_readme_example_parses() -> None:
    spec = load_spec(EXAMPLE)
    assert spec.name == "demo"
    assert spec.roles["unified"].replicas == 2
    assert spec.router.port == 8000


def test_defaults_fill_what_the_spec_leaves_out() -> None:
    spec = parse_spec({"model": "demo", "roles": {"unified": {"replicas": 3}}})
    assert isinstance(spec, FleetSpec)
    assert spec.name == "default" and spec.namespace == "kvyard-default"
    assert spec.roles["prefill"].replicas == 0
    assert spec.roles["unified"].placement.num_cpus == 1.0 and spec.roles["unified"].placement.spread
    assert spec.router.replicas == 1 and spec.router.policy == "cache_aware" and spec.router.host == "127.0.0.1"
    assert spec.kv_tier.redis_url is None
    assert spec.with_replicas("unified", 5).roles["unified"].replicas == 5
    assert spec.with_routers(3).router.replicas == 3 and spec.with_routers(3).router.policy == "cache_aware"
    with pytest.raises(SpecError, match=r"router\.replicas"):
        spec.with_routers(0)


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"roles": {"unified": {"replicas": 1}}}, "model"),
        ({"model": "demo", "roles": {"unified": {"replica": 1}}}, "roles.unified.replica"),
        ({"model": "demo", "roles": {"unified": {"replicas": -1}}}, "roles.unified.replicas"),
        ({"model": "demo", "roles": {"unified": {"replicas": "two"}}}, "roles.unified.replicas"),
        ({"model": "demo", "roles": {"mixed": {"replicas": 1}}}, "roles.mixed"),
        ({"model": "demo", "roles": {}}, "roles"),
        ({"model": "demo", "roles": {"prefill": {"replicas": 1}}}, "roles.prefill"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1, "num_cpus": "a lot"}}}, "roles.unified.num_cpus"),
        (
            {"model": "demo", "roles": {"unified": {"replicas": 1, "resources": {"gpu_a": -1}}}},
            "roles.unified.resources.gpu_a",
        ),
        (
            {"model": "demo", "roles": {"unified": {"replicas": 1, "options": "--max-num-seqs 8"}}},
            "roles.unified.options",
        ),
        ({"model": "demo", "roles": {"unified": {"replicas": 1, "options": ["--port", "9"]}}}, "roles.unified.options"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1, "ports": "9000"}}}, "roles.unified.ports"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1, "ports": "9100-9000"}}}, "roles.unified.ports"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1, "ports": [9000, "x"]}}}, "roles.unified.ports"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1, "host": 7}}}, "roles.unified.host"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "router": {"port": 70000}}, "router.port"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "router": {"policy": "fastest"}}, "router.policy"),
        (
            {"model": "demo", "roles": {"unified": {"replicas": 1}}, "router": {"options": ["--admin-key", "x"]}},
            "router.options",
        ),
        (
            {"model": "demo", "roles": {"unified": {"replicas": 1}}, "kv_tier": {"redis_url": "http://x"}},
            "kv_tier.redis_url",
        ),
        ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "name": "Has Spaces"}, "name"),
        ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "colour": "blue"}, "colour"),
        ({"external_replicas": [{"url": "10.0.0.1:8000"}]}, r"external_replicas[0].url"),
        ({"external_replicas": [{"url": "http://h:1", "events": "h:5557"}]}, r"external_replicas[0].events"),
        ({"external_replicas": [{"url": "http://h:1", "port": 1}]}, r"external_replicas[0].port"),
        ({"external_replicas": [{"url": "http://h:1"}, {"url": "http://h:1/"}]}, "each URL once"),
        ({"external_replicas": "http://h:1"}, "external_replicas"),
        (["not", "a", "mapping"], "the fleet spec"),
        (_with_ray("6379"), "ray must be a mapping"),
        (_with_ray({"gcs_port": 6379}), "ray.gcs_port: unknown field"),
        (_with_ray({"port": "6379"}), "ray.port"),
        (_with_ray({"port": True}), "ray.port"),
        (_with_ray({"port": 80}), "ray.port must be an integer of at least 1024"),
        (_with_ray({"node_manager_port": 70000}), "ray.node_manager_port must be at most 65535"),
        (_with_ray({"ray_client_server_port": 10001.5}), "ray.ray_client_server_port"),
        (_with_ray({"worker_ports": "10002"}), "ray.worker_ports must be a range"),
        (_with_ray({"worker_ports": "10999-10002"}), "ray.worker_ports must run from a port to a later one"),
        (_with_ray({"worker_ports": "500-999"}), "ray.worker_ports must run from a port to a later one within 1024"),
        (_with_ray({"worker_ports": [10002, 70000]}), "ray.worker_ports"),
        (_with_ray({"worker_ports": "10002-10004"}), "ray.worker_ports 10002-10004 holds 3 port(s)"),
        (_with_ray({"node_ip_address": "my-laptop"}), "ray.node_ip_address must be an IP address"),
        (_with_ray({"node_ip_address": "127.0.0.1"}), "ray.node_ip_address: Ray replaces a loopback address"),
        (_with_ray({"node_ip_address": 10}), "ray.node_ip_address"),
        (
            _with_ray({"port": 6379, "node_manager_port": 6379}),
            "ray.port (6379) and ray.node_manager_port (6379) overlap",
        ),
        (
            _with_ray({"port": 10500, "worker_ports": "10002-10999"}),
            "ray.port (10500) and ray.worker_ports (10002-10999)",
        ),
        (_with_ray({"worker_ports": "7000-8000"}), "ray.worker_ports (7000-8000) and router.port (8000) overlap"),
        (_with_ray({"metrics_export_port": 8001}, router={"replicas": 2}), "and router.port (8000-8001) overlap"),
        (
            _with_ray({"worker_ports": "10002-10999"}, roles={"unified": {"replicas": 1, "ports": "10900-11000"}}),
            "ray.worker_ports (10002-10999) and roles.unified.ports (10900-11000) overlap",
        ),
    ],
)
def test_a_bad_spec_names_its_field(document: Any, field: str) -> None:
    with pytest.raises(SpecError, match=re.escape(field)):
        parse_spec(document)


def test_the_ray_section_sets_the_ports_of_the_head_kvyard_starts() -> None:
    assert parse_spec(_with_ray(None)).ray == RaySpec() and not RaySpec().is_set  # no section: Ray chooses
    spec = load_spec(PORTS_EXAMPLE)
    assert spec.ray.port == 6390 and spec.ray.worker_ports == (10002, 10999) and spec.ray.is_set
    section = {
        "node_ip_address": "10.0.0.5",
        "port": 6390,
        "node_manager_port": 6391,
        "object_manager_port": 6392,
        "ray_client_server_port": 6393,
        "dashboard_agent_listen_port": 6394,
        "dashboard_agent_grpc_port": 6395,
        "runtime_env_agent_port": 6396,
        "metrics_export_port": 6397,
        "worker_ports": [10002, 10999],
    }
    ray = parse_spec(_with_ray(section)).ray
    assert ray.fields_set() == [f"ray.{name}" for name in section]
    client = ["--ray-client-server-port=6393"] if ray_client_installed() else []  # Ray refuses it without ray[client]
    assert head_command(ray)[1:] == [
        "start",
        "--head",
        "--disable-usage-stats",
        "--include-dashboard=false",
        "--node-ip-address=10.0.0.5",
        "--port=6390",
        "--node-manager-port=6391",
        "--object-manager-port=6392",
        *client,
        "--dashboard-agent-listen-port=6394",
        "--dashboard-agent-grpc-port=6395",
        "--runtime-env-agent-port=6396",
        "--metrics-export-port=6397",
        "--min-worker-port=10002",
        "--max-worker-port=10999",
    ]
    assert head_command(RaySpec())[1:] == ["start", "--head", "--disable-usage-stats", "--include-dashboard=false"]


def test_the_ray_worker_ports_hold_one_for_each_worker_process() -> None:
    """2 replicas, 2 routers, the controller and 3 `kvyard deploy` commands at once: 8 ports."""
    fleet = {"model": "demo", "roles": {"unified": {"replicas": 2}}, "router": {"replicas": 2}}
    assert parse_spec({**fleet, "ray": {"worker_ports": "10002-10009"}}).ray.worker_ports == (10002, 10009)
    with pytest.raises(SpecError, match=r"holds 7 port\(s\).*2 replica\(s\), 2 router\(s\), the controller .* need 8"):
        parse_spec({**fleet, "ray": {"worker_ports": "10002-10008"}})


def test_a_role_says_where_its_replicas_listen() -> None:
    spec = parse_spec(
        {
            "model": "demo",
            "roles": {
                "unified": {"replicas": 2, "host": "127.0.0.1", "ports": "9100-9109"},
                "decode": {"replicas": 1, "ports": [9200, 9200]},
                "prefill": {"replicas": 1},
            },
        }
    )
    assert (spec.roles["unified"].host, spec.roles["unified"].ports) == ("127.0.0.1", (9100, 9109))
    assert (spec.roles["decode"].host, spec.roles["decode"].ports) == (None, (9200, 9200))  # its node's address
    assert spec.roles["prefill"].ports is None  # any free port


def _held_port_with_a_free_neighbour() -> socket.socket:
    """A listening socket on a port below the kernel's ephemeral range whose next port is free: ports the kernel
    hands to the suite's own loopback connections would make the neighbour busy by chance."""
    for busy in random.sample(range(20000, 30000), 200):
        taken = socket.socket()
        with socket.socket() as probe:
            try:
                taken.bind(("127.0.0.1", busy))
                probe.bind(("127.0.0.1", busy + 1))
            except OSError:
                taken.close()
                continue
        taken.listen()
        return taken
    pytest.skip("no two adjacent free ports in 20000-30000")


def test_a_port_is_taken_from_the_range_and_a_taken_one_is_passed_over() -> None:
    with _held_port_with_a_free_neighbour() as taken:
        busy = taken.getsockname()[1]
        assert free_port("127.0.0.1", (busy, busy + 1)) == busy + 1
        with pytest.raises(ProcessFailed, match=f"no free port on 127.0.0.1 in {busy}-{busy}"):
            free_port("127.0.0.1", (busy, busy))


def test_replicas_the_fleet_does_not_run_are_listed_with_their_kv_events() -> None:
    spec = parse_spec(
        {
            "external_replicas": [
                {"url": "http://10.0.0.1:8000/", "events": "tcp://10.0.0.1:5557"},
                {"url": "http://10.0.0.2:8000"},
            ]
        }
    )
    assert not any(role.replicas for role in spec.roles.values())  # a fleet of vLLM servers only: no model needed
    first, second = spec.external_replicas
    assert first.url == "http://10.0.0.1:8000" and str(first.events) == "tcp://10.0.0.1:5557"
    assert second.events is None


def test_the_command_refuses_a_bad_spec_before_touching_ray(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.yaml"
    spec.write_text("model: demo\nroles:\n  unified:\n    replicas: [1]\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "deploy", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "roles.unified.replicas" in result.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "kvyard", "deploy", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "cannot read the fleet spec" in missing.stderr
    scale = subprocess.run(
        [sys.executable, "-m", "kvyard", "deploy", "--name", "x", "--scale", "unified=many"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert scale.returncode == 2 and "ROLE=N" in scale.stderr

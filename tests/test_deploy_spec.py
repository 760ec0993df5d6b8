"""The fleet spec of `kvyard deploy`: what it accepts, and errors that name the field."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvyard.deploy.process import ProcessFailed, free_port
from kvyard.deploy.spec import FleetSpec, SpecError, load_spec, parse_spec

EXAMPLE = Path(__file__).parent.parent / "examples" / "fleet.yaml"


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


@pytest.mark.parametrize(("document", "field"), [
    ({"roles": {"unified": {"replicas": 1}}}, "model"),
    ({"model": "demo", "roles": {"unified": {"replica": 1}}}, "roles.unified.replica"),
    ({"model": "demo", "roles": {"unified": {"replicas": -1}}}, "roles.unified.replicas"),
    ({"model": "demo", "roles": {"unified": {"replicas": "two"}}}, "roles.unified.replicas"),
    ({"model": "demo", "roles": {"mixed": {"replicas": 1}}}, "roles.mixed"),
    ({"model": "demo", "roles": {}}, "roles"),
    ({"model": "demo", "roles": {"prefill": {"replicas": 1}}}, "roles.prefill"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "num_cpus": "a lot"}}}, "roles.unified.num_cpus"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "resources": {"gpu_a": -1}}}},
     "roles.unified.resources.gpu_a"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "options": "--max-num-seqs 8"}}}, "roles.unified.options"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "options": ["--port", "9"]}}}, "roles.unified.options"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "ports": "9000"}}}, "roles.unified.ports"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "ports": "9100-9000"}}}, "roles.unified.ports"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "ports": [9000, "x"]}}}, "roles.unified.ports"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1, "host": 7}}}, "roles.unified.host"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "router": {"port": 70000}}, "router.port"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "router": {"policy": "fastest"}}, "router.policy"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "router": {"options": ["--admin-key", "x"]}},
     "router.options"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "kv_tier": {"redis_url": "http://x"}},
     "kv_tier.redis_url"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "name": "Has Spaces"}, "name"),
    ({"model": "demo", "roles": {"unified": {"replicas": 1}}, "colour": "blue"}, "colour"),
    ({"external_replicas": [{"url": "10.0.0.1:8000"}]}, r"external_replicas[0].url"),
    ({"external_replicas": [{"url": "http://h:1", "events": "h:5557"}]}, r"external_replicas[0].events"),
    ({"external_replicas": [{"url": "http://h:1", "port": 1}]}, r"external_replicas[0].port"),
    ({"external_replicas": [{"url": "http://h:1"}, {"url": "http://h:1/"}]}, "each URL once"),
    ({"external_replicas": "http://h:1"}, "external_replicas"),
    (["not", "a", "mapping"], "the fleet spec"),
])  # fmt: skip
def test_a_bad_spec_names_its_field(document: Any, field: str) -> None:
    with pytest.raises(SpecError, match=re.escape(field)):
        parse_spec(document)


def test_a_role_says_where_its_replicas_listen() -> None:
    spec = parse_spec({"model": "demo", "roles": {"unified": {"replicas": 2, "host": "127.0.0.1", "ports": "9100-9109"},
                                                  "decode": {"replicas": 1, "ports": [9200, 9200]},
                                                  "prefill": {"replicas": 1}}})  # fmt: skip
    assert (spec.roles["unified"].host, spec.roles["unified"].ports) == ("127.0.0.1", (9100, 9109))
    assert (spec.roles["decode"].host, spec.roles["decode"].ports) == (None, (9200, 9200))  # its node's address
    assert spec.roles["prefill"].ports is None  # any free port


def test_a_port_is_taken_from_the_range_and_a_taken_one_is_passed_over() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        taken.listen()
        if busy < 65535:
            assert free_port("127.0.0.1", (busy, busy + 1)) == busy + 1
        with pytest.raises(ProcessFailed, match=f"no free port on 127.0.0.1 in {busy}-{busy}"):
            free_port("127.0.0.1", (busy, busy))


def test_replicas_the_fleet_does_not_run_are_listed_with_their_kv_events() -> None:
    spec = parse_spec({"external_replicas": [{"url": "http://10.0.0.1:8000/", "events": "tcp://10.0.0.1:5557"},
                                             {"url": "http://10.0.0.2:8000"}]})  # fmt: skip
    assert not any(role.replicas for role in spec.roles.values())  # a fleet of vLLM servers only: no model needed
    first, second = spec.external_replicas
    assert first.url == "http://10.0.0.1:8000" and str(first.events) == "tcp://10.0.0.1:5557"
    assert second.events is None


def test_the_command_refuses_a_bad_spec_before_touching_ray(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.yaml"
    spec.write_text("model: demo\nroles:\n  unified:\n    replicas: [1]\n")
    result = subprocess.run([sys.executable, "-m", "kvyard", "deploy", str(spec)], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert "roles.unified.replicas" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "kvyard", "deploy", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "cannot read the fleet spec" in missing.stderr
    scale = subprocess.run([sys.executable, "-m", "kvyard", "deploy", "--name", "x", "--scale", "unified=many"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert scale.returncode == 2 and "ROLE=N" in scale.stderr

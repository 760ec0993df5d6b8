"""Reaching a Ray cluster: the one named by --address or $RAY_ADDRESS, else one already running on this machine,
else (for a deploy) a single-node cluster started here, on the spec's `ray` ports, remembered so
`kvyard deploy --down` can stop it."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from kvyard.deploy.spec import RaySpec
from kvyard.paths import cache_root

LOCAL_HEAD_MARKER = "ray-local-head"  # under kvyard's cache directory: this machine's head was started by kvyard


class NoCluster(RuntimeError):
    pass


def connect(address: str | None, namespace: str, start_local: RaySpec | None) -> bool:
    """Connect this process to Ray in `namespace`; True when a local head was started for it (`start_local`: the
    head to start when no cluster runs; None: start none)."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    started = False
    if address is not None:
        _say_ignored(start_local, f"this deploy joins the Ray cluster at {address} (--address or $RAY_ADDRESS)")
    else:
        address = "auto"
        if _local_cluster_running():
            _say_ignored(start_local, "this deploy joins the Ray cluster already running on this machine")
        elif start_local is None:
            raise NoCluster("no Ray cluster is running here; give --address (or $RAY_ADDRESS)")
        else:
            start_local_head(start_local)
            started = True
    try:
        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
            configure_logging=True,
        )
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise NoCluster(f"cannot connect to the Ray cluster at {address}: {error}") from None
    return started


def head_command(head: RaySpec) -> list[str]:
    """`ray start --head` with the spec's address and ports (each field is the option of the same name)."""
    flags = [_ray_command(), "start", "--head", "--disable-usage-stats", "--include-dashboard=false"]
    if head.node_ip_address is not None:
        flags.append(f"--node-ip-address={head.node_ip_address}")
    for name, port in head.single_ports().items():
        if name != "ray_client_server_port" or ray_client_installed():
            flags.append(f"--{name.replace('_', '-')}={port}")
    if head.worker_ports is not None:
        flags += [f"--min-worker-port={head.worker_ports[0]}", f"--max-worker-port={head.worker_ports[1]}"]
    return flags


def ray_client_installed() -> bool:
    """Ray starts its client server only with `ray[client]` (grpcio), and refuses a client port without it."""
    return importlib.util.find_spec("grpc") is not None


def start_local_head(head: RaySpec) -> None:
    command = head_command(head)
    _say(f"starting a single-node Ray cluster on this machine ({' '.join(['ray', *command[1:]])}) ...")
    if head.ray_client_server_port is not None and not ray_client_installed():
        _say("ray.ray_client_server_port is left out: without ray[client] installed, Ray starts no client server")
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NoCluster(f"ray start --head failed ({result.returncode}):\n{result.stderr[-2000:]}")
    _marker().write_text("started by kvyard deploy\n")


def stop_local_head_if_ours() -> bool:
    """Stop this machine's Ray cluster if kvyard started it; True when it did."""
    marker = _marker()
    if not marker.exists():
        return False
    subprocess.run([_ray_command(), "stop"], capture_output=True, check=False)
    marker.unlink(missing_ok=True)
    return True


def _local_cluster_running() -> bool:
    """A cluster started on this machine (`ray start`) leaves its address where `ray.init("auto")` looks."""
    return Path("/tmp/ray/ray_current_cluster").exists() and _ray_status_ok()


def _ray_status_ok() -> bool:
    result = subprocess.run([_ray_command(), "status"], capture_output=True, check=False, timeout=60)
    return result.returncode == 0


def _say_ignored(head: RaySpec | None, why: str) -> None:
    if head is not None and head.is_set:
        _say(
            f"warning: the spec's ray section ({', '.join(head.fields_set())}) is ignored: {why}, which keeps the "
            "ports it was started with; it applies only to the cluster kvyard deploy starts when none runs "
            "(docs/deploy.md)"
        )


def _say(message: str) -> None:
    print(f"kvyard deploy: {message}", file=sys.stderr, flush=True)


def _ray_command() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def _marker() -> Path:
    path = cache_root() / LOCAL_HEAD_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    return path

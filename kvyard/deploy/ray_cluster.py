"""Reaching a Ray cluster: the one named by --address or $RAY_ADDRESS, else one already running on this machine,
else (for a deploy) a single-node cluster started here, remembered so `kvyard deploy --down` can stop it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from kvyard.paths import cache_root

LOCAL_HEAD_MARKER = "ray-local-head"  # under kvyard's cache directory: this machine's head was started by kvyard


class NoCluster(RuntimeError):
    pass


def connect(address: str | None, namespace: str, start_local: bool) -> bool:
    """Connect this process to Ray in `namespace`; True when a local head was started for it."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    started = False
    if address is None:
        address = "auto"
        if not _local_cluster_running():
            if not start_local:
                raise NoCluster("no Ray cluster is running here; give --address (or $RAY_ADDRESS)")
            start_local_head()
            started = True
    try:
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False,
                 configure_logging=True)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise NoCluster(f"cannot connect to the Ray cluster at {address}: {error}") from None
    return started


def start_local_head() -> None:
    print("kvyard deploy: starting a single-node Ray cluster on this machine (ray start --head) ...", file=sys.stderr,
          flush=True)  # fmt: skip
    result = subprocess.run([_ray_command(), "start", "--head", "--disable-usage-stats", "--include-dashboard=false"],
                            capture_output=True, text=True, check=False)  # fmt: skip
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


def _ray_command() -> str:
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def _marker() -> Path:
    path = cache_root() / LOCAL_HEAD_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    return path

"""Start a real `kvyard route` process on loopback for tests, and read its state."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvyard.testing.sim_cluster import TEST_ADMIN_KEY
from tests.server_utils import ADMIN, ServerProcess, free_port


def start_router(
    log_dir: Path,
    replicas: list[str],
    *extra: str,
    timeout: float = 60.0,
    replicas_publish_events: bool = True,
    wait_healthy: bool = True,
) -> ServerProcess:
    """A router over `replicas`, returned once every replica is healthy and (when replicas publish KV events) its
    cache index synced; with `wait_healthy` False, once its admin API answers."""
    port = free_port()
    log_path = log_dir / f"router-{port}.log"
    command = [
        sys.executable,
        "-m",
        "kvyard",
        "route",
        "--port",
        str(port),
        "--health-interval-s",
        "0.2",
        "--admin-key",
        TEST_ADMIN_KEY,
        "--replica-admin-key",
        TEST_ADMIN_KEY,
    ]
    for url in replicas:
        command += ["--replica", url]
    with log_path.open("wb") as log:
        process = subprocess.Popen([*command, *extra], stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    router = ServerProcess(process, port, log_path)
    admin_off = "--admin-key" in extra and extra[list(extra).index("--admin-key") + 1] == ""
    try:
        if not wait_healthy:
            wait_for(lambda: _listed(router), timeout, "router listening")
        elif admin_off:  # no admin API to ask: wait until the router serves
            wait_for(lambda: _healthy(router), timeout, "router healthy")
        else:
            count = len(replicas) + extra.count("--prefill") + extra.count("--decode")
            wait_for(lambda: _all_ready(router, count, replicas_publish_events), timeout, "router ready")
    except BaseException:
        router.stop()
        raise
    return router


def _healthy(router: ServerProcess) -> bool:
    if router.process.poll() is not None:
        raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.log()}")
    try:
        return httpx.get(f"{router.url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _listed(router: ServerProcess) -> bool:
    if router.process.poll() is not None:
        raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.log()}")
    try:
        return admin(router, "GET", "/admin/replicas").status_code == 200
    except httpx.TransportError:
        return False


def _all_ready(router: ServerProcess, count: int, synced: bool) -> bool:
    if router.process.poll() is not None:
        raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.log()}")
    try:
        listed = replicas_of(router)
    except httpx.TransportError:
        return False
    return len(listed) == count and all(
        r["state"] == "healthy" and r["models"] and (r["resyncs"] or not synced) for r in listed
    )


def admin(router: ServerProcess, method: str, path: str, **options: Any) -> httpx.Response:
    """A call to the router's admin API, with the admin key."""
    return httpx.request(method, f"{router.url}{path}", headers=ADMIN, timeout=10, **options)


def replicas_of(router: ServerProcess) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = admin(router, "GET", "/admin/replicas").json()["replicas"]
    return replicas


def replica_state(router: ServerProcess, url: str) -> dict[str, Any]:
    return next(r for r in replicas_of(router) if r["url"] == url)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        time.sleep(0.05)


def labelled_metric(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{"):
            continue
        label_text = line[len(name) + 1 : line.index("}")]
        if all(f'{key}="{value}"' in label_text for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total

"""One kvyard process of a fleet (a replica's `kvyard serve`, a router's `kvyard route`), owned by a Ray actor.

The process is the actor's child and lives exactly as long as the actor: it is started by a thread that waits
on it for its whole life and asks the kernel to kill it when that thread ends (PR_SET_PDEATHSIG), so an actor
killed with SIGKILL takes its server with it; and when the server dies on its own, the actor's process exits,
so Ray restarts the actor, which starts a new server. Secrets reach the child in its environment, never on its
command line (which every user of the node can read).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1
_PORT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str  # e.g. replica-unified-0; names the log file
    command: tuple[str, ...]  # the kvyard command and its options, without --host and --port
    env: dict[str, str] = field(default_factory=dict)  # added to the node's environment (secrets go here)
    host: str | None = None  # None: listen on this node's address, for the routers on other nodes
    port: int | None = None  # None: a free port (from `ports`, when given)
    ports: tuple[int, int] | None = None  # the inclusive range a free port is taken from
    log_dir: str = "/tmp/kvyard-deploy"
    ready_timeout_s: float = 600.0
    ready_path: str = "/health"  # answers 200 once the process serves (a router's /health waits for a replica)


class ProcessFailed(RuntimeError):
    """The process exited, or never became ready; the message ends with its last log lines."""


class KvyardProcess:
    """Starts the process at construction and returns once it is ready (answers `ready_path`)."""

    def __init__(self, spec: ProcessSpec, node_ip: str) -> None:
        self.spec = spec
        self.node_ip = node_ip
        self.host = spec.host or node_ip
        self.log_path = Path(spec.log_dir) / f"{spec.name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        self._stopping = threading.Event()
        self._child: subprocess.Popen[bytes] | None = None
        self._healthy_once = False
        for attempt in range(_PORT_ATTEMPTS):
            self.port = spec.port or free_port(self.host, spec.ports)
            try:
                self._start_and_wait()
                return
            except ProcessFailed as failure:
                if spec.port is not None or "in use" not in str(failure) or attempt == _PORT_ATTEMPTS - 1:
                    raise

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def info(self) -> dict[str, object]:
        child = self._child
        return {
            "name": self.spec.name,
            "url": self.url,
            "node_ip": self.node_ip,
            "actor_pid": os.getpid(),
            "pid": child.pid if child is not None else None,
            "started_at": self.started_at,
            "log": str(self.log_path),
        }

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM (the server finishes what it serves), SIGKILL after `grace_s`; the exit code."""
        self._stopping.set()
        child = self._child
        if child is None:
            return None
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        return child.returncode

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            with self.log_path.open(errors="replace") as log:
                return "".join(deque(log, maxlen=num_lines))
        except OSError:
            return ""

    def _start_and_wait(self) -> None:
        started = threading.Event()
        threading.Thread(target=self._keep, args=(started,), name=f"keeper {self.spec.name}", daemon=True).start()
        started.wait()
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while not self._healthy():
            child = self._child
            assert child is not None
            if child.poll() is not None:
                raise ProcessFailed(
                    f"{self.spec.name} exited with {child.returncode} before it was ready:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop(grace_s=5)
                raise ProcessFailed(
                    f"{self.spec.name} did not answer {self.spec.ready_path} within "
                    f"{self.spec.ready_timeout_s:g} s:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def _keep(self, started: threading.Event) -> None:
        """Start the child and wait for it, on this thread (the parent the kernel watches), for its whole life."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("KVYARD_")}
        env.update(self.spec.env)
        argv = [sys.executable, "-m", "kvyard", *self.spec.command, "--host", self.host, "--port", str(self.port)]
        with self.log_path.open("ab") as log:
            log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv[2:])}\n".encode())
            log.flush()
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,
            )
        self._child = child
        started.set()
        child.wait()
        if self._stopping.is_set():
            return
        if self._healthy_once:
            # The server died under a live actor: end the actor too, so Ray restarts both.
            print(
                f"kvyard deploy: {self.spec.name} exited with {child.returncode}; restarting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{self.spec.ready_path}", timeout=1.0) as response:
                healthy: bool = response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False
        self._healthy_once = self._healthy_once or healthy
        return healthy


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (the actor died)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str, ports: tuple[int, int] | None = None) -> int:
    """A port nothing listens on at `host`: any (the kernel's choice), or one of the range, tried in random order
    (replicas starting together on one node do not all try the same one first)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    candidates = [0] if ports is None else random.sample(range(ports[0], ports[1] + 1), ports[1] - ports[0] + 1)
    for candidate in candidates:
        with socket.socket(family) as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
            port: int = sock.getsockname()[1]
            return port
    raise ProcessFailed(f"no free port on {host} in {ports[0]}-{ports[1]}" if ports else f"no free port on {host}")

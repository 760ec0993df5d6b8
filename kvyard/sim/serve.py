"""Serve simulated replicas on loopback ports: many replicas, one process, one asyncio loop.

`serve_forever` backs `kvyard sim`; `SimCluster` runs the same replicas on a background thread
for tests and benchmarks that drive them from the calling process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from aiohttp import web

from kvyard.sim.http_api import create_app
from kvyard.sim.replica import SimConfig, SimReplica

_LOG = logging.getLogger("kvyard.sim")


@dataclass(slots=True)
class RunningReplicas:
    replicas: list[SimReplica] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    runners: list[web.AppRunner] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for runner in self.runners:
            await runner.cleanup()


async def start_replicas(configs: Sequence[SimConfig], host: str = "127.0.0.1", port: int = 0) -> RunningReplicas:
    """Replica i listens on `port + i`, or on a free port of its own when `port` is 0."""
    running = RunningReplicas()
    try:
        for index, config in enumerate(configs):
            replica = SimReplica(config, index)
            runner = web.AppRunner(create_app(replica), handler_cancellation=True, access_log=None)
            await runner.setup()
            running.runners.append(runner)
            await web.TCPSite(runner, host, port + index if port else 0, backlog=4096).start()
            running.ports.append(_bound_port(runner))
            running.replicas.append(replica)
            task = asyncio.create_task(replica.run(), name=f"sim-replica-{index}")
            task.add_done_callback(_report_crash)
            running.tasks.append(task)
    except BaseException:
        await running.stop()
        raise
    return running


def _bound_port(runner: web.AppRunner) -> int:
    address = runner.addresses[-1]
    return int(address[1])


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        _LOG.error("simulated replica loop %s crashed", task.get_name(), exc_info=task.exception())


def serve_forever(configs: Sequence[SimConfig], host: str, port: int, ports_file: Path | None = None) -> int:
    async def main() -> None:
        running = await start_replicas(configs, host, port)
        ready = {"ports": running.ports, "urls": [f"http://{host}:{p}" for p in running.ports]}
        if ports_file is not None:
            ports_file.write_text(json.dumps(ready))
        print(json.dumps(ready), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await running.stop()

    try:
        asyncio.run(main())
    except OSError as error:
        print(f"error: cannot serve simulated replicas: {error}", file=sys.stderr)
        return 1
    return 0


class SimCluster:
    """Simulated replicas served from a background thread: `with SimCluster([config] * 3) as sim: sim.urls`.

    `replicas` are live objects of the background loop: read them only while no request is running.
    """

    def __init__(self, configs: Sequence[SimConfig], host: str = "127.0.0.1") -> None:
        self.configs = list(configs)
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sim-cluster", daemon=True)
        self._running: RunningReplicas | None = None

    @property
    def urls(self) -> list[str]:
        assert self._running is not None, "the cluster is not started"
        return [f"http://{self.host}:{port}" for port in self._running.ports]

    @property
    def replicas(self) -> list[SimReplica]:
        assert self._running is not None, "the cluster is not started"
        return self._running.replicas

    def __enter__(self) -> SimCluster:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(start_replicas(self.configs, self.host), self._loop)
        try:
            self._running = future.result(timeout=30)
        except BaseException:
            self._shutdown()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._running is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._running.stop(), self._loop).result(timeout=30)
        self._shutdown()

    def _shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

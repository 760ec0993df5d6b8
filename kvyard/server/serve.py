"""Host replica apps on ports, and many replicas in one process (simulated ones: `kvyard sim`).

Nothing here loads a model (see `model_server` for `kvyard serve`), so hosting simulated replicas never
imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import orjson

from kvyard.api.auth import Access
from kvyard.net.http_server import Endpoint, HttpServer
from kvyard.server.app import ReplicaApp
from kvyard.server.backend import ReplicaEngine
from kvyard.server.options import ServerOptions

T = TypeVar("T")


@dataclass(slots=True)
class Hosted:
    """One replica app listening on a port, with the background work it needs (a simulator's step loop)."""

    app: ReplicaApp
    server: HttpServer
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace_s: float) -> None:
        """Refuse new requests, end KV-event streams, let requests in progress finish for up to `grace_s`."""
        self.app.begin_shutdown()
        await self.server.shutdown(grace_s)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def host(app: ReplicaApp, host_name: str, port: int, background: Sequence[Awaitable[None]] = ()) -> Hosted:
    server = HttpServer(app.handle, app.options.http)
    await server.start(host_name, port)
    tasks = [asyncio.ensure_future(work) for work in background]
    return Hosted(app, server, tasks)


async def wait_for_stop_signal(apps: Sequence[ReplicaApp] = ()) -> None:
    """Wait for SIGINT or SIGTERM; meanwhile SIGHUP makes `apps` read their API-key files again."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def reload_keys() -> None:
        for app in apps:
            app.reload_keys()

    loop.add_signal_handler(signal.SIGHUP, reload_keys)
    await stop.wait()


async def stop_within(stop: Callable[[float], Awaitable[object]], grace_s: float) -> None:
    """`stop(grace_s)`, unless a second SIGINT or SIGTERM comes meanwhile: then `stop(0)`, at once (requests in
    flight are cut off), as a second Ctrl-C ends uvicorn."""
    again = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, again.set)
    graceful = asyncio.ensure_future(stop(grace_s))
    second = asyncio.ensure_future(again.wait())
    await asyncio.wait({graceful, second}, return_when=asyncio.FIRST_COMPLETED)
    second.cancel()
    if not graceful.done():
        say("second signal: stopping now, cutting off the requests in flight")
        await stop(0.0)
        graceful.cancel()
        await asyncio.gather(graceful, return_exceptions=True)


def say(message: str) -> None:
    print(f"kvyard: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- many engines in one process


ExtraRoutes = Callable[[ReplicaApp], Mapping[tuple[str, str], Endpoint]]


@dataclass(slots=True)
class ReplicaSpec:
    """An engine to serve, its background work, admin routes beyond the replica API (made for its app), and its
    own server options (a replica's role), else the ones all replicas share."""

    engine: ReplicaEngine
    background: Callable[[], Awaitable[None]] | None = None
    admin_routes: ExtraRoutes | None = None
    options: ServerOptions | None = None


async def host_replicas(
    specs: Sequence[ReplicaSpec], options: ServerOptions, host_name: str = "127.0.0.1", port: int = 0
) -> list[Hosted]:
    """Replica i listens on `port + i`, or on a free port of its own when `port` is 0; a spec's own options replace
    `options`."""
    hosted: list[Hosted] = []
    try:
        for index, spec in enumerate(specs):
            app = ReplicaApp(spec.options or options, spec.engine)
            if spec.admin_routes is not None:
                app.add_routes(spec.admin_routes(app), Access.ADMIN)
            background = [spec.background()] if spec.background is not None else []
            hosted.append(await host(app, host_name, port + index if port else 0, background))
    except BaseException:
        await asyncio.gather(*(h.stop(0) for h in hosted), return_exceptions=True)
        raise
    return hosted


def serve_replicas(
    make_specs: Callable[[], list[ReplicaSpec]],
    options: ServerOptions,
    host_name: str,
    port: int,
    ports_file: Path | None = None,
) -> int:
    """Serve the replicas until SIGINT/SIGTERM; prints (and writes to `ports_file`) their ports and URLs."""
    import uvloop

    async def main() -> None:
        hosted = await host_replicas(make_specs(), options, host_name, port)
        # What exists now lives as long as the process: block pools, tier maps (a simulated fleet's shared store
        # grows to millions of stand-in blocks). Frozen, it is no longer walked by every full garbage collection,
        # each of which stalled all replicas of the process.
        gc.freeze()
        ports = [h.port for h in hosted]
        urls = [f"http://{host_name}:{p}" for p in ports]
        ready = {"ports": ports, "urls": urls}
        if ports_file is not None:  # whole or absent: a reader polling for the file never sees it half written
            partial = ports_file.with_name(f".{ports_file.name}.partial")
            partial.write_text(orjson.dumps(ready).decode())
            partial.replace(ports_file)
        print(orjson.dumps(ready).decode(), flush=True)
        say(f"{len(hosted)} replica(s) ready: {' '.join(urls)}")
        await wait_for_stop_signal([h.app for h in hosted])
        say("shutting down")

        async def stop_all(grace_s: float) -> None:
            await asyncio.gather(*(h.stop(grace_s) for h in hosted))

        await stop_within(stop_all, options.shutdown_grace_s)
        say("stopped")

    try:
        uvloop.run(main())
    except OSError as error:
        say(f"error: cannot serve the replicas: {error}")
        return 1
    return 0


class ReplicaCluster:
    """Replicas served from a background thread, for tests and benchmarks that drive them from the calling
    process: `with ReplicaCluster(make_specs) as cluster: cluster.urls`. `engines` are live objects of the
    background loop: read them only while no request is running."""

    def __init__(
        self, make_specs: Callable[[], list[ReplicaSpec]], options: ServerOptions, host_name: str = "127.0.0.1"
    ) -> None:
        self.make_specs = make_specs
        self.options = options
        self.host = host_name
        self.engines: list[ReplicaEngine] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-cluster", daemon=True)
        self._hosted: list[Hosted] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{h.port}" for h in self._hosted]

    def __enter__(self) -> ReplicaCluster:
        self._thread.start()
        try:
            self._hosted = self._run(self._start, timeout=30)
        except BaseException:
            self._shutdown()
            raise
        return self

    async def _start(self) -> list[Hosted]:
        specs = self.make_specs()
        self.engines = [spec.engine for spec in specs]
        return await host_replicas(specs, self.options, self.host)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        with contextlib.suppress(Exception):
            self._run(self._stop, timeout=30)
        self._shutdown()

    async def _stop(self) -> None:
        await asyncio.gather(*(h.stop(1.0) for h in self._hosted))

    def _run(self, work: Callable[[], Coroutine[object, object, T]], timeout: float) -> T:
        """Run `work()` on the cluster's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(work(), self._loop).result(timeout=timeout)

    def _shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

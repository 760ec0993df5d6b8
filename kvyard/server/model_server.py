"""`kvyard serve`: one replica of a model, over the replica API.

It listens at once (`/health` answers 503 while the model loads on a worker thread; a weight package is served
from the native kernels while PyTorch loads, kvyard.engine.fast_start.engine), says on stderr what it is doing, and on
SIGINT/SIGTERM stops admitting requests, ends the KV-event streams, lets in-flight requests finish for up to
`--shutdown-grace-s`, then exits 0. A model that fails to load (PyTorch's engine included, after a fast start)
ends the process with exit code 1 and the reason on stderr: a replica that cannot serve should not look alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvyard.api.auth import admin_key_of
from kvyard.engine.config import EngineConfig
from kvyard.engine.fast_start.engine import NativeStartEngine, fast_start_blocker
from kvyard.server.app import ReplicaApp
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.options import ServerOptions
from kvyard.server.serve import host, say, stop_within, wait_for_stop_signal

if TYPE_CHECKING:
    from kvyard.engine.llm_engine import LLMEngine

T = TypeVar("T")


def serve_model(engine: EngineConfig, options: ServerOptions, host_name: str, port: int) -> int:
    """Run `kvyard serve` until SIGINT/SIGTERM; the exit code."""
    import uvloop

    return uvloop.run(_serve_model(engine, options, host_name, port))


async def _serve_model(config: EngineConfig, options: ServerOptions, host_name: str, port: int) -> int:
    app = ReplicaApp(options)
    try:
        hosted = await host(app, host_name, port)
    except OSError as error:
        say(f"cannot listen on {host_name}:{port}: {error}")
        return 1
    scheme = "https" if options.http.ssl_certfile else "http"
    say(f"listening on {scheme}://{host_name}:{hosted.port} (/health answers 503 until the model has loaded)")
    engine_box: list[AsyncEngine] = []
    loader = asyncio.create_task(_load(app, config, engine_box))
    stopper = asyncio.create_task(wait_for_stop_signal([app]))
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loader.done() and app.load_error is not None:
        stopper.cancel()
        await hosted.stop(0)
        return 1
    await stopper
    say(
        f"shutting down: finishing {app.in_flight} request(s) in flight (at most {options.shutdown_grace_s:g} s; "
        "a second Ctrl-C stops at once)"
    )
    loader.cancel()
    await stop_within(hosted.stop, options.shutdown_grace_s)
    for engine in engine_box:
        await asyncio.to_thread(engine.stop)
    say("stopped")
    return 0


async def _load(app: ReplicaApp, config: EngineConfig, engine_box: list[AsyncEngine]) -> None:
    say(f"loading {config.model} ...")
    say(f"KV tier: {config.kv_tier.describe() if config.kv_tier else 'off'}")
    started = time.monotonic()
    admin_key = admin_key_of(app.options.access.admin_key)
    # Prefill replicas share the fleet's admin key; without one there is no PD.
    pull_headers = {"authorization": f"Bearer {admin_key}"} if admin_key is not None else None
    native = await _native_start(app, config, engine_box, pull_headers) if app.options.fast_start else None
    try:
        kv_buffers = native.engine.kv_buffers if native and isinstance(native.engine, NativeStartEngine) else None
        engine = await _on_own_thread(_torch_engine, config, kv_buffers)
    except Exception as error:
        if native is not None:  # requests waiting for it get a 503 with the reason; the replica then exits
            native.fail_takeover(error)
        app.load_error = error
        say(f"error: the model failed to load: {error}")
        return
    if native is not None:
        try:
            await native.take_over(engine)
        except Exception as error:
            native.fail_takeover(error)
            engine.close()
            app.load_error = error
            say(f"error: the PyTorch engine could not take over: {error}")
            return
        say(f"PyTorch engine loaded and took over in {time.monotonic() - started:.1f} s")
        return
    _serve_with(app, engine, engine_box, pull_headers)
    say(
        f"model {engine.model_name} loaded in {time.monotonic() - started:.1f} s: "
        f"{engine.num_kv_blocks} KV blocks of {config.block_size} tokens; ready"
    )
    paged = engine.expert_residency_snapshot()
    if paged is not None:
        say(
            f"experts paged from disk: {paged.resident_experts} of {paged.experts} in memory "
            f"({paged.resident_bytes / 1024**3:.2f} GB of experts); the cache: kvyard_expert_cache_* in /metrics, "
            "and a log line a minute at --log-level info"
        )


def _serve_with(
    app: ReplicaApp,
    engine: LLMEngine | NativeStartEngine,
    engine_box: list[AsyncEngine],
    pull_headers: dict[str, str] | None,
) -> AsyncEngine:
    """Start the engine on its thread and let the app serve it (its pulls enabled where the fleet has a key)."""
    if pull_headers is not None:
        engine.enable_pulls(pull_headers)
    async_engine = AsyncEngine(engine, asyncio.get_running_loop())
    async_engine.start()
    engine_box.append(async_engine)
    app.set_engine(async_engine)
    return async_engine


def _torch_engine(config: EngineConfig, kv_buffers: list[Any] | None) -> LLMEngine:
    from kvyard.engine.llm_engine import LLMEngine  # PyTorch, imported off the event loop: /health answers meanwhile

    return LLMEngine(config, kv_buffers)


async def _on_own_thread(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` on a thread that ends with it: a thread that ran OpenMP keeps its team of workers while
    it lives (kvyard.kernels.threads), and asyncio's own pool threads live on."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvyard-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, function, *args)
    finally:
        executor.shutdown(wait=False)


async def _native_start(
    app: ReplicaApp, config: EngineConfig, engine_box: list[AsyncEngine], pull_headers: dict[str, str] | None
) -> AsyncEngine | None:
    """Serve from the native fast-start engine, where the configuration allows it (None: it does not)."""
    started = time.monotonic()
    try:
        blocker = fast_start_blocker(config)
        if blocker is not None:
            say(f"no fast start: {blocker}")
            return None
        engine = await _on_own_thread(NativeStartEngine, config)
    except Exception as error:  # the PyTorch engine loads next and says what is wrong, if anything is
        say(f"no fast start: {error}")
        return None
    async_engine = _serve_with(app, engine, engine_box, pull_headers)
    say(
        f"model {engine.model_name} ready in {time.monotonic() - started:.1f} s on the native kernels "
        f"({engine.num_kv_blocks} KV blocks of {config.block_size} tokens); PyTorch loading"
    )
    return async_engine

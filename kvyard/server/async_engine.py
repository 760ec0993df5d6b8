"""Run the engine loop on its own thread and hand results to asyncio coroutines.

The HTTP layer never touches `LLMEngine` directly: it sends commands (add, abort, snapshot) through a
queue, and the engine thread delivers each step's outputs to per-request asyncio queues with one
`call_soon_threadsafe` per step. The event loop therefore stays free while the model runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.registry import Collector

from kvyard.api.checks import ContextLimits
from kvyard.api.errors import APIError
from kvyard.engine.core import EngineStats, KVSnapshot, RequestOutput
from kvyard.engine.fast_start.engine import NativeStartEngine
from kvyard.engine.kv_links.exports import ExportRead
from kvyard.engine.pooling.params import PoolingParams
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.request import KVTransferParams
from kvyard.kvcache.events import KVEventLog
from kvyard.server.expert_metrics import ExpertCacheCollector
from kvyard.server.kv_tier_metrics import KVTierCollector, KVTransferCollector
from kvyard.server.vocabulary import HFVocabulary

if TYPE_CHECKING:  # PyTorch: the server answers before it loads (kvyard.engine.fast_start.engine)
    from kvyard.engine.llm_engine import LLMEngine

    Engine = LLMEngine | NativeStartEngine


class EngineDeadError(APIError):
    """The engine thread stopped after an internal error; the server must be restarted."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(503, f"engine stopped: {cause}", code="engine_dead")


@dataclass(slots=True)
class _Command:
    run: Callable[[Engine], Any]
    future: asyncio.Future[Any] | None = None


@dataclass(slots=True)
class AsyncEngine:
    engine: Engine
    loop: asyncio.AbstractEventLoop
    error: BaseException | None = None
    # While a fast-start engine serves: done once LLMEngine has taken over (or with the error it failed with).
    _takeover: asyncio.Future[None] | None = None
    _stats: EngineStats | None = None
    _commands: queue.Queue[_Command | None] = field(default_factory=queue.Queue)
    _streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _wake: threading.Event = field(default_factory=threading.Event)
    _vocabulary: HFVocabulary | None = None
    # Reads the KV of pinned blocks for transfers, off both the event loop and the engine thread.
    _export_reader: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvyard-kv-export")
    )

    def start(self) -> None:
        if isinstance(self.engine, NativeStartEngine):
            self._takeover = self.loop.create_future()
        if self.engine.tokenizer is not None:
            self._vocabulary = HFVocabulary(self.engine.tokenizer)
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="kvyard-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._export_reader.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # ----------------------------------------------------------------- the replica engine interface

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def limits(self) -> ContextLimits:
        return self.engine.limits

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.scheduler.max_num_seqs

    @property
    def scheduling_policy(self) -> str:
        return self.engine.config.scheduler.scheduling_policy

    @property
    def vocabulary(self) -> HFVocabulary | None:
        return self._vocabulary

    def check_ready(self) -> None:
        if self.error is not None:
            raise EngineDeadError(self.error)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        final_only: bool = False,
        resumed_output_ids: Sequence[int] = (),
        kv_transfer: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        await self._engine_that_runs(params)

        def add(engine: Engine) -> Any:
            return engine.add_request(request_id, prompt_token_ids, params, cache_salt, resumed_output_ids, kv_transfer)

        async for output in self._outputs(request_id, add, final_only):
            yield output

    async def pool(
        self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, cache_salt: str | None = None
    ) -> RequestOutput:
        if self._takeover is not None and isinstance(self.engine, NativeStartEngine):
            await asyncio.shield(self._takeover)  # the native runner pools nothing: wait for PyTorch's
        params = SamplingParams(max_tokens=1)

        def add(engine: Engine) -> Any:
            return engine.add_request(request_id, prompt_token_ids, params, cache_salt, pooling=pooling)

        async for output in self._outputs(request_id, add, final_only=True):
            return output
        raise RuntimeError(f"pooling request {request_id} ended without an output")

    async def _outputs(
        self, request_id: str, add: Callable[[Engine], Any], final_only: bool
    ) -> AsyncIterator[RequestOutput]:
        """Add a request on the engine thread (`add`) and yield its outputs; leaving early aborts it."""
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            await self.call(add)
            pending: RequestOutput | None = None
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                pending = item if pending is None else pending.merge(item)
                if finished or not final_only:
                    yield pending
                    pending = None
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _engine_that_runs(self, params: SamplingParams) -> None:
        """Wait for LLMEngine when the fast-start engine serving now cannot sample these params as it would."""
        engine, takeover = self.engine, self._takeover
        if takeover is None or not isinstance(engine, NativeStartEngine) or engine.runs_natively(params):
            return
        await asyncio.shield(takeover)  # raises why LLMEngine never took over, if it did not

    async def take_over(self, engine: LLMEngine) -> None:
        """Let `engine` continue the fast-start engine's requests and blocks from its next step on."""

        def swap(current: Engine) -> None:
            if not isinstance(current, NativeStartEngine):
                raise RuntimeError("only a fast-start engine is taken over")
            engine.use_compute_threads()  # on the engine thread, now that PyTorch computes here
            engine.take_over(current)
            self.engine = engine
            self._publish_stats()

        await self.call(swap)
        if self._takeover is not None and not self._takeover.done():
            self._takeover.set_result(None)

    def fail_takeover(self, error: BaseException) -> None:
        """LLMEngine will not take over: requests waiting for it get a 503 saying why."""
        if self._takeover is not None and not self._takeover.done():
            self._takeover.set_exception(
                APIError(503, f"the replica's PyTorch engine failed to load: {error}", code="engine_unavailable")
            )
            self._takeover.exception()  # retrieved: no "never retrieved" warning when nobody waits

    def abort(self, request_id: str) -> None:
        self._submit(_Command(lambda engine: engine.abort_request(request_id)))

    async def read_export(self, transfer_id: str, start: int) -> ExportRead | None:
        view = self.engine.kv_exports.view(transfer_id, start)  # cheap: no thread hop while nothing is ready
        if view is None or not view.block_ids:
            return None if view is None else ExportRead([], view)
        read: ExportRead | None = await self.loop.run_in_executor(
            self._export_reader, self.engine.read_export, transfer_id, start
        )
        return read

    async def release_export(self, transfer_id: str) -> bool:
        released: bool = await self.call(lambda engine: engine.release_export(transfer_id))
        return released

    def stats(self) -> EngineStats:
        assert self._stats is not None, "stats() before start()"
        return self._stats

    def kv_event_log(self) -> KVEventLog | None:
        return self.engine.kv_event_log()

    async def kv_snapshot(self) -> KVSnapshot:
        snapshot: KVSnapshot = await self.call(lambda engine: engine.kv_snapshot())
        return snapshot

    def collectors(self) -> list[Collector]:
        # Read through self.engine on every scrape: LLMEngine may take over from a fast-start engine.
        def puller_counters() -> Any:
            return self.engine.kv_puller.counters() if self.engine.kv_puller else None

        def residency() -> Any:  # a fast-start engine pages nothing (fast_start_blocker)
            engine = self.engine
            return None if isinstance(engine, NativeStartEngine) else engine.expert_residency_snapshot()

        return [
            KVTierCollector(lambda: self.engine.kv_tier_snapshot(), self.model_name),
            KVTransferCollector(lambda: self.engine.kv_exports, puller_counters, self.model_name),
            ExpertCacheCollector(residency, self.model_name),
        ]

    def server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.engine_config.model, "dtype": str(self.engine.dtype).removeprefix("torch.")}

    async def call(self, function: Callable[[Engine], Any]) -> Any:
        """Run `function(engine)` on the engine thread between steps and return its result."""
        self.check_ready()
        future: asyncio.Future[Any] = self.loop.create_future()
        self._submit(_Command(function, future))
        return await future

    def _submit(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ----------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            self.engine.use_compute_threads()
            while self._drain_commands():
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._publish_stats()
                    if outputs:
                        self.loop.call_soon_threadsafe(self._deliver, outputs)
                else:
                    self.engine.housekeeping()
                    self._publish_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as error:
            self.error = error
            self.loop.call_soon_threadsafe(self._fail_all, error)

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            self._execute(command)

    def _execute(self, command: _Command) -> None:
        try:
            result = command.run(self.engine)
        except Exception as error:
            if command.future is not None:
                self.loop.call_soon_threadsafe(_set_exception, command.future, error)
            return
        if command.future is not None:
            self.loop.call_soon_threadsafe(_set_result, command.future, result)

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()

    # ----------------------------------------------------------------- event loop side

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError(error))


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

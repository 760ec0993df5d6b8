"""One simulated replica's engine in real time: the engine core with a cost runner, stepped on the event loop.

The loop runs a step, advances a wall-clock deadline by the step's cost (times `time_scale`), sleeps
until then and hands the step's outputs to their requests. While the deadline is less than `tick_s`
ahead, steps run back to back without sleeping (their tokens may arrive up to `tick_s` early): a
longer tick means fewer wake-ups, so less CPU, at the cost of timing resolution. Outputs reach a
stream at most every `stream_interval_s` (a first token at once), merged, which bounds the HTTP
writes. A replica the process held up for less than `catch_up_s` catches up on its schedule
(`sim.clock`); one held up longer runs late, never faster, and the time it skipped is `clock.lag_s`, exported
as `kvyard_sim_lag_seconds` so a benchmark can tell.

Many of these run in one process and one event loop (`kvyard sim --replicas N`), so nothing here
blocks: a step is arithmetic on the scheduler's state.

Prefill/decode disaggregation works as on a real replica (`sim.transfer`): a prefill replica's leased blocks are
sent as small stand-in blocks over HTTP, a decode replica pulls them on the engine's pull threads, and its request
is admitted once the modeled transfer time has passed; meanwhile the loop checks again every tick instead of
waiting on the load. Loads from the KV tier below the device cache (`sim.tier`: a host tier per replica, a store shared
by the replicas of the process) are waited for the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvyard.api.checks import ContextLimits
from kvyard.api.errors import APIError
from kvyard.api.metrics import MODEL_NAME, counter_family, gauge_family
from kvyard.engine.core import EngineCore, EngineStats, KVSnapshot, RequestOutput
from kvyard.engine.kv_links.exports import ExportRead
from kvyard.engine.kv_links.pull_link import KVPullLink, PullCounters
from kvyard.engine.pooling.params import PoolingParams
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.request import KVTransferParams
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.pd_stream import PullLimits
from kvyard.kvcache.stats import StoreSnapshot
from kvyard.sim.clock import StepClock
from kvyard.sim.config import SimConfig
from kvyard.sim.cost_runner import CostRunner
from kvyard.sim.modeled_pulls import ModeledPuller, ModeledTransfers, StandInBlocks
from kvyard.sim.tier import ModeledLoads, ModeledTierLink, build_tier_link
from kvyard.sim.tokens import ByteTokenizer

IDLE_WAKE_S = 0.5
MIN_LOAD_POLL_S = 0.001  # while only pulls are pending, look again this often even with tick_s 0
RESTARTED = "the replica restarted while serving this request"


@dataclass(slots=True)
class _Stream:
    """Outputs of one request waiting for its reader, merged into one."""

    final_only: bool  # the reader wants the whole answer: wake it only at the end
    pending: RequestOutput | None = None
    error: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, output: RequestOutput) -> None:
        self.pending = output if self.pending is None else self.pending.merge(output)
        if output.finished or not self.final_only:
            self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def next(self) -> RequestOutput:
        while True:
            if self.error is not None:
                raise self.error
            if self.pending is not None and (self.pending.finished or not self.final_only):
                output, self.pending = self.pending, None
                return output
            self.ready.clear()
            await self.ready.wait()


CollectorFactory = Callable[["SimEngine"], Collector]


class SimEngine:
    """`admin_key`: the fleet's admin key, which this replica sends when it pulls a prompt's blocks from a prefill
    replica (none: it computes every prompt itself). `collectors`: more metrics of this engine, made for it
    (the KV-transfer counters, whose collector lives with the server). `shared_store`: the KV store every replica
    of the process shares (see `tier.shared_store`), used when `config.shared_store_blocks` is set."""

    def __init__(
        self,
        config: SimConfig,
        index: int = 0,
        admin_key: str | None = None,
        collectors: Sequence[CollectorFactory] = (),
        shared_store: MemoryTier | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.healthy = True  # False (set through the fault-injection API) answers 503
        self.started = time.time()
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._vocabulary = ByteTokenizer()
        self._pull_headers = {"authorization": f"Bearer {admin_key}"} if admin_key else None
        self.puller: ModeledPuller | None = None
        self.shared_store = shared_store
        self.tier: ModeledTierLink | None = None
        self._fresh_state()
        self._collectors: list[Collector] = [_SimCollector(self), *(make(self) for make in collectors)]

    def _fresh_state(self) -> None:
        """An empty cache, host tier included, and a new event log (sequence from 1): a newly started replica. The
        shared store keeps what it holds."""
        core, runner = self.config.build_core()
        core.block_reader = StandInBlocks()
        self._close_links()
        self.puller = self._make_puller()
        self.tier = build_tier_link(self.config, self.shared_store)
        core.attach_tier(self.tier)
        core.attach_puller(self.puller, block_on_loads=False)
        self.core: EngineCore = core
        self.runner: CostRunner = runner
        self.clock = StepClock(self.config.catch_up_s)

    def _make_puller(self) -> ModeledPuller | None:
        """The deadline is a time of the modeled engine, so it scales with time_scale; the idle timeout watches the
        HTTP peer itself, which sends heartbeats every wall second (see SimConfig.kv_transfer)."""
        if self._pull_headers is None:
            return None
        transfer = self.config.kv_transfer
        limits = PullLimits(
            transfer.kv_transfer_timeout_s * self.config.time_scale, transfer.kv_transfer_idle_s, self._pull_headers
        )
        return ModeledPuller(KVPullLink(StandInBlocks(), limits), self.config)

    def pull_counters(self) -> PullCounters | None:
        """How pulls from prefill replicas went (None: this replica does not pull)."""
        return self.puller.link.counters() if self.puller is not None else None

    def modeled_transfers(self) -> ModeledTransfers:
        return self.puller.modeled() if self.puller is not None else ModeledTransfers()

    def modeled_tier_loads(self) -> dict[str, ModeledLoads]:
        """What tier loads would have cost, by the tier that served them (empty: no tier)."""
        return self.tier.modeled() if self.tier is not None else {}

    def tier_snapshot(self) -> StoreSnapshot | None:
        """The KV tier's counters, as `kvyard serve` exports them (None: no tier)."""
        tier = self.tier
        return tier.snapshot() if tier is not None else None

    def _close_links(self) -> None:
        if self.puller is not None:
            self.puller.close()
            self.puller = None
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def restart(self) -> None:
        """Behave like a replica that crashed and came back: every request in flight fails, the cache is gone."""
        for stream in self._streams.values():
            stream.fail(APIError(503, RESTARTED, code="replica_restarted"))
        self._streams.clear()
        self._fresh_state()
        self._wake.set()

    # ------------------------------------------------------------------ the replica engine interface

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def limits(self) -> ContextLimits:
        return self.core.limits

    @property
    def max_num_seqs(self) -> int:
        return self.config.scheduler.max_num_seqs

    @property
    def scheduling_policy(self) -> str:
        return self.config.scheduler.scheduling_policy

    @property
    def vocabulary(self) -> ByteTokenizer:
        return self._vocabulary

    def check_ready(self) -> None:
        if not self.healthy:
            raise APIError(503, "this simulated replica is set unhealthy", code="unhealthy", retry_after=1)

    def server_info(self) -> dict[str, Any]:
        config = self.config
        return {
            "chunked_prefill_size": config.scheduler.max_num_batched_tokens,
            "prefill_only_step_tokens": config.scheduler.prefill_only_step_tokens,
            "prefill_order": config.scheduler.prefill_order,
            "simulated": True,
            "replica_index": self.index,
            "time_scale": config.time_scale,
            "cost_model": config.cost.to_json(),
        }

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
        """Add a request and yield its outputs; closing the iterator early aborts the request."""
        self.check_ready()
        self.core.add_request(request_id, prompt_token_ids, params, cache_salt, resumed_output_ids, kv_transfer)
        stream = self._streams[request_id] = _Stream(final_only)
        self._wake.set()
        finished = False
        try:
            while not finished:
                output = await stream.next()
                finished = output.finished
                yield output
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                if not finished:
                    self.core.abort_request(request_id)

    async def pool(
        self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams, cache_salt: str | None = None
    ) -> RequestOutput:
        message = "a simulated replica has no hidden states: it computes no embeddings or scores"
        raise APIError(400, message, "model", "model_cannot_pool")

    async def read_export(self, transfer_id: str, start: int) -> ExportRead | None:
        return self.core.read_export(transfer_id, start)

    async def release_export(self, transfer_id: str) -> bool:
        return self.core.release_export(transfer_id)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def kv_event_log(self) -> KVEventLog | None:
        return self.core.kv_event_log()

    async def kv_snapshot(self) -> KVSnapshot:
        return self.core.kv_snapshot()

    def collectors(self) -> list[Collector]:
        return list(self._collectors)

    # ------------------------------------------------------------------ the step loop

    async def run(self) -> None:
        try:
            await self._step_loop()
        finally:
            self._close_links()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_delivery = loop.time()
        self.clock.restart(last_delivery)
        pending: list[RequestOutput] = []
        while True:
            core, runner, clock = self.core, self.runner, self.clock
            steps_before = runner.num_steps
            outputs = core.step()
            if runner.num_steps == steps_before:
                if core.loads_pending():  # requests wait for pulled blocks: look again shortly, never spin
                    self._deliver(pending)
                    await asyncio.sleep(max(self.config.tick_s, MIN_LOAD_POLL_S))
                    clock.restart(loop.time())
                    continue
                if core.has_unfinished_requests():
                    await asyncio.sleep(0)  # only preemptions: the next schedule admits them again
                    continue
                self._deliver(pending)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):  # wake now and then for upkeep (transfer leases)
                    await asyncio.wait_for(self._wake.wait(), IDLE_WAKE_S)
                clock.restart(loop.time())
                continue
            step_end = clock.schedule(loop.time(), runner.last_step_seconds * self.config.time_scale)
            pending.extend(outputs)
            delay = step_end - loop.time()
            # Between back-to-back steps, still let the HTTP side run.
            await asyncio.sleep(delay if delay >= self.config.tick_s else 0)
            now = loop.time()
            if any(len(o.token_ids) == 1 for o in outputs) or now - last_delivery >= self.config.stream_interval_s:
                self._deliver(pending)
                last_delivery = now

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.push(output)
        outputs.clear()


class _SimCollector(Collector):
    """The simulator's own counters, read at scrape time, labelled with the model it serves as a real replica's."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        model = self.engine.model_name
        yield gauge_family(
            "kvyard_sim_lag_seconds",
            "Total time the simulated replica ran behind its cost model (the process could not keep up)",
            model,
            self.engine.clock.lag_s,
        )
        yield gauge_family(
            "kvyard_sim_busy_seconds",
            "Total wall time the simulated replica spent on steps (cost model times time scale)",
            model,
            self.engine.clock.busy_s,
        )
        modeled = self.engine.modeled_transfers()
        yield counter_family(
            "kvyard_sim_transfer_model_bytes",
            "KV bytes the blocks pulled here would have moved in the simulated model",
            model,
            modeled.bytes,
        )
        yield counter_family(
            "kvyard_sim_transfer_model_seconds",
            "Simulated seconds pulls were held back after "
            "their last block arrived (what a streamed transfer would still take)",
            model,
            modeled.seconds,
        )
        yield from self._tier_loads(model)

    def _tier_loads(self, model: str) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loads, by_source = self.engine.modeled_tier_loads(), [MODEL_NAME, "source"]
        tokens = CounterMetricFamily(
            "kvyard_sim_tier_hit_tokens",
            "Prompt tokens loaded from the KV tier, by the tier that served them (host, shared)",
            labels=by_source,
        )
        nbytes = CounterMetricFamily(
            "kvyard_sim_tier_model_bytes",
            "KV bytes those loads would have moved in the simulated model",
            labels=by_source,
        )
        seconds = CounterMetricFamily(
            "kvyard_sim_tier_model_seconds",
            "Simulated seconds charged for tier loads (latency plus bytes over bandwidth, misses included)",
            labels=by_source,
        )
        for source, modeled in sorted(loads.items()):
            tokens.add_metric([model, source], modeled.tokens)
            nbytes.add_metric([model, source], modeled.bytes)
            seconds.add_metric([model, source], modeled.seconds)
        yield from (tokens, nbytes, seconds)
        store = self.engine.shared_store
        if store is not None and self.engine.config.shared_store_blocks:
            yield gauge_family(
                "kvyard_sim_shared_store_blocks",
                "Blocks in the store the replicas of this process share",
                model,
                len(store),
            )

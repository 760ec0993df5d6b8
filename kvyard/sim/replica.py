"""One simulated replica in real time: its scheduler loop, request streams, metrics and load report.

The loop runs a step, advances a wall-clock deadline by the step's cost (times `time_scale`), sleeps
until then and hands the step's tokens to their requests. While the deadline is less than `tick_s`
ahead, steps run back to back without sleeping (their tokens may arrive up to `tick_s` early): a
longer tick means fewer wake-ups, so less CPU, at the cost of timing resolution. Tokens reach a
stream at most every `stream_interval_s` (a first token at once), which bounds the HTTP writes. When
the process cannot keep up, the replica runs late, never faster; the total delay is exported as
`kvyard_sim_lag_seconds` so a benchmark can tell.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge

from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.events import KVEventLog
from kvyard.server.metrics import ServerMetrics
from kvyard.sim.cost_model import CostModel
from kvyard.sim.prefix_cache import PrefixCache
from kvyard.sim.scheduler import SchedulerLimits, SimRequest, SimScheduler, TokenOutput
from kvyard.sim.tokens import output_seed

# A step may start this late (timer jitter) without counting as lag: the next steps make up for it.
LAG_TOLERANCE_S = 0.005


@dataclass(frozen=True, slots=True)
class SimConfig:
    model_name: str = "kvyard-sim"
    model_digest: str = "sim"  # with model_name, dtype and block_size: the block-key namespace
    dtype: str = "float32"
    block_size: int = 16
    capacity_blocks: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131072
    vocab_size: int = 32000
    max_queued_requests: int = 1024  # requests admitted beyond max_num_seqs before answering 429
    time_scale: float = 1.0  # wall seconds per simulated second
    stream_interval_s: float = 0.002  # least wall time between two deliveries of later tokens
    tick_s: float = 0.002  # steps ending less than this ahead of the wall clock run without sleeping
    cost: CostModel = field(default_factory=CostModel)
    event_log_capacity: int = 65536

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        for name in ("stream_interval_s", "tick_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("capacity_blocks", "max_model_len", "vocab_size", "event_log_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(self.model_name, self.model_digest, self.dtype, self.block_size)

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.block_size, self.max_num_batched_tokens, self.max_num_seqs)


@dataclass(slots=True)
class RequestStream:
    """Tokens of one request as the replica delivers them; the HTTP handler drains it."""

    request: SimRequest
    wake_per_token: bool = True  # False: the reader wants the whole answer, so wake it only at the end
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished: bool = False
    _pending: list[int] = field(default_factory=list)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, token_ids: list[int], finished: bool) -> None:
        self._pending.extend(token_ids)
        self.finished = self.finished or finished
        if self.wake_per_token or self.finished:
            self._ready.set()

    async def next_tokens(self) -> tuple[list[int], bool]:
        """Tokens delivered since the last call (waiting for at least one, or for the end unless
        `wake_per_token`), and whether the request is done."""
        while not self.finished and not (self._pending and self.wake_per_token):
            self._ready.clear()
            await self._ready.wait()
        tokens, self._pending = self._pending, []
        return tokens, self.finished


@dataclass(slots=True)
class _SimGauges:
    lag: Gauge
    busy: Gauge


class SimReplica:
    def __init__(self, config: SimConfig, index: int = 0) -> None:
        self.config = config
        self.index = index
        self.namespace = config.namespace
        self.streams: dict[str, RequestStream] = {}
        self.in_flight = 0
        self.healthy = True  # False (set through the API) answers 503, to test routers' fault handling
        self._root_keys: dict[str, bytes] = {}
        self._wake = asyncio.Event()
        self._fresh_state()

    def _fresh_state(self) -> None:
        """An empty cache, a new event log (sequence from 1) and zeroed metrics: a newly started replica."""
        config = self.config
        self.cache = PrefixCache(config.capacity_blocks, KVEventLog(config.event_log_capacity))
        self.scheduler = SimScheduler(config.limits, self.cache)
        self.metrics = ServerMetrics()
        self.sim_gauges = _SimGauges(
            Gauge("kvyard_sim_lag_seconds", "Total time the simulated replica ran behind its cost model "
                  "(the process could not keep up)", registry=self.metrics.registry),
            Gauge("kvyard_sim_busy_seconds", "Total wall time the simulated replica spent on steps (cost model "
                  "times time scale)", registry=self.metrics.registry),
        )  # fmt: skip
        self.lag_s = 0.0
        self.busy_s = 0.0
        self.started = time.time()

    def restart(self) -> None:
        """Behave like a replica that crashed and came back: every request in flight fails, the cache is gone."""
        for stream in list(self.streams.values()):
            self.scheduler.abort(stream.request)
            stream.push([], finished=True)
        self.streams.clear()
        self._fresh_state()
        self._wake.set()

    @property
    def events(self) -> KVEventLog:
        return self.cache.events

    # ------------------------------------------------------------------ requests

    def root_key(self, cache_salt: str | None) -> bytes:
        salt = cache_salt or ""
        key = self._root_keys.get(salt)
        if key is None:
            key = self._root_keys[salt] = self.namespace.with_salt(salt).root_key()
        return key

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, cache_salt: str | None,
               seed: int | None, streaming: bool = True) -> RequestStream:  # fmt: skip
        request = SimRequest(request_id, prompt, max_tokens, self.root_key(cache_salt), output_seed(prompt, seed),
                             self.config.block_size)  # fmt: skip
        stream = RequestStream(request, wake_per_token=streaming)
        self.streams[request_id] = stream
        self.scheduler.add(request)
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        if self.streams.pop(stream.request.request_id, None) is None:
            return
        self.scheduler.abort(stream.request)
        self.metrics.requests.labels(outcome="abort").inc()

    # ------------------------------------------------------------------ the step loop

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        scale, cost = self.config.time_scale, self.config.cost
        step_end = last_delivery = loop.time()
        pending: list[TokenOutput] = []
        while True:
            plan = self.scheduler.schedule()
            if plan.preempted and not plan.chunks:
                continue  # the preempted requests are admitted again by the next schedule
            if not plan.chunks:  # idle, or nothing fits until a request finishes or is aborted
                self._deliver(pending)
                self._wake.clear()
                await self._wake.wait()
                step_end = loop.time()
                continue
            now = loop.time()
            if step_end < now - LAG_TOLERANCE_S:
                self.lag_s += now - step_end
                step_end = now
            seconds = cost.step_seconds(plan.shape) * scale
            step_end += seconds
            self.busy_s += seconds
            outputs = self.scheduler.complete(plan)
            pending.extend(outputs)
            delay = step_end - loop.time()
            # Between back-to-back steps, still let the HTTP side run.
            await asyncio.sleep(delay if delay >= self.config.tick_s else 0)
            now = loop.time()
            if any(o.first for o in outputs) or now - last_delivery >= self.config.stream_interval_s:
                self._deliver(pending)
                last_delivery = now

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        if not outputs:
            return
        now = time.monotonic()
        grouped: dict[str, tuple[list[int], bool]] = {}
        for output in outputs:
            tokens, _ = grouped.setdefault(output.request.request_id, ([], False))
            tokens.append(output.token_id)
            if output.finished:
                grouped[output.request.request_id] = (tokens, True)
        for request_id, (tokens, finished) in grouped.items():
            stream = self.streams.get(request_id)
            if stream is None:
                continue
            self._observe(stream, len(tokens), now)
            if finished:
                self._count_finished(stream, now)
            stream.push(tokens, finished)
        outputs.clear()

    def _observe(self, stream: RequestStream, num_tokens: int, now: float) -> None:
        if stream.last_token_time is None:
            stream.first_token_time = now
            self.metrics.ttft.observe(now - stream.arrival)
            num_tokens -= 1
        else:
            gap = (now - stream.last_token_time) / num_tokens
            for _ in range(num_tokens):
                self.metrics.inter_token.observe(gap)
        stream.last_token_time = now

    def _count_finished(self, stream: RequestStream, now: float) -> None:
        request, metrics = stream.request, self.metrics
        del self.streams[request.request_id]
        metrics.e2e.observe(now - stream.arrival)
        metrics.requests.labels(outcome=request.finish_reason or "length").inc()
        metrics.prompt_tokens.inc(request.num_prompt_tokens)
        metrics.cached_prompt_tokens.inc(max(0, request.num_cached_tokens))
        metrics.generation_tokens.inc(request.num_output_tokens)

    # ------------------------------------------------------------------ reports

    def load(self) -> dict[str, Any]:
        used, total = self.cache.num_used_blocks, self.config.capacity_blocks
        return {
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "in_flight_requests": self.in_flight,
            "kv_blocks_used": used,
            "kv_blocks_total": total,
            "kv_usage": used / total,
            "tokens_in_flight": self.scheduler.tokens_in_flight,
        }

    def refresh_gauges(self) -> None:
        m, scheduler = self.metrics, self.scheduler
        m.waiting.set(len(scheduler.waiting))
        m.running.set(len(scheduler.running))
        m.kv_blocks_used.set(self.cache.num_used_blocks)
        m.kv_blocks_total.set(self.config.capacity_blocks)
        m.prefix_queried.set(scheduler.num_queried_tokens)
        m.prefix_hits.set(scheduler.num_hit_tokens)
        m.preemptions.set(scheduler.num_preemptions)
        self.sim_gauges.lag.set(self.lag_s)
        self.sim_gauges.busy.set(self.busy_s)

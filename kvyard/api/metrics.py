"""Prometheus metrics of one replica, in a registry owned by the app (no global state): the names every
replica exports, real or simulated."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Names of counters that clients (kvyard bench) read off a replica's /metrics (exported with `_total` added).
REQUESTS = "kvyard_requests"  # label `outcome`: stop, length, abort, rejected_overload
PROMPT_TOKENS = "kvyard_prompt_tokens"
GENERATION_TOKENS = "kvyard_generation_tokens"
CACHED_PROMPT_TOKENS = "kvyard_cached_prompt_tokens"
SPEC_PROPOSED = "kvyard_spec_proposed_tokens"
SPEC_ACCEPTED = "kvyard_spec_accepted_tokens"
SPEC_VERIFICATIONS = "kvyard_spec_verifications"
REJECTED_OVERLOAD = "rejected_overload"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCounters(Protocol):
    """The engine's statistics the gauges show (the engine's `EngineStats`)."""

    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def kv_blocks_used(self) -> int: ...
    @property
    def kv_blocks_total(self) -> int: ...
    @property
    def prefix_cache_queried_tokens(self) -> int: ...
    @property
    def prefix_cache_hit_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def spec_proposed_tokens(self) -> int: ...
    @property
    def spec_accepted_tokens(self) -> int: ...
    @property
    def spec_verifications(self) -> int: ...


# The engine's running totals, exported as counters (`_total` added), and its current state, as gauges; both read
# from the engine's statistics at scrape time: (attribute of EngineCounters, name, help).
_ENGINE_TOTALS = (
    ("prefix_cache_queried_tokens", "kvyard_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache"),
    ("prefix_cache_hit_tokens", "kvyard_prefix_cache_hit_tokens", "Tokens found in the prefix cache"),
    ("num_preemptions", "kvyard_num_preemptions", "Requests preempted"),
    ("spec_proposed_tokens", SPEC_PROPOSED, "Speculative decoding: tokens proposed and verified"),
    ("spec_accepted_tokens", SPEC_ACCEPTED, "Speculative decoding: proposed tokens the model agreed with, each a "
     "decode step saved"),
    ("spec_verifications", SPEC_VERIFICATIONS, "Speculative decoding: steps of a request that verified proposals; "
     "accepted tokens / this is the mean accepted run"),
)  # fmt: skip
_ENGINE_GAUGES = (
    ("num_waiting", "kvyard_num_requests_waiting", "Requests waiting to be scheduled"),
    ("num_running", "kvyard_num_requests_running", "Requests being processed"),
    ("kv_blocks_used", "kvyard_kv_blocks_used", "KV blocks referenced by requests"),
    ("kv_blocks_total", "kvyard_kv_blocks_total", "KV blocks in the pool"),
)


class EngineCollector(Collector):
    """The engine's statistics, read when /metrics is scraped (nothing when no engine has loaded yet)."""

    def __init__(self, stats: Callable[[], EngineCounters | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.stats()
        if stats is None:
            return
        for attribute, name, documentation in _ENGINE_TOTALS:
            yield CounterMetricFamily(name, documentation, value=getattr(stats, attribute))
        for attribute, name, documentation in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, documentation, value=getattr(stats, attribute))


@dataclass(slots=True)
class ServerMetrics:
    """`engine_stats`: what the engine counts (None before it has loaded)."""

    engine_stats: Callable[[], EngineCounters | None] = lambda: None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ttft: Histogram = field(init=False)
    inter_token: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    requests: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    cached_prompt_tokens: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.ttft = Histogram("kvyard_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.inter_token = Histogram("kvyard_inter_token_latency_seconds", "Time between output tokens",
                                     registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram("kvyard_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.requests = Counter(REQUESTS, "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Generated tokens", registry=r)
        self.cached_prompt_tokens = Counter(CACHED_PROMPT_TOKENS, "Prompt tokens served from the prefix cache, as "
                                            "reported in usage", registry=r)  # fmt: skip
        r.register(EngineCollector(self.engine_stats))

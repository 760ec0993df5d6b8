"""Prometheus metrics of one replica, in a registry owned by the app (no global state): the names every
replica exports, real or simulated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Names of the counters that clients (kvyard bench) read off a replica's /metrics, as exported (`_total` added).
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


@dataclass(slots=True)
class ServerMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ttft: Histogram = field(init=False)
    inter_token: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    requests: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    cached_prompt_tokens: Counter = field(init=False)
    waiting: Gauge = field(init=False)
    running: Gauge = field(init=False)
    kv_blocks_used: Gauge = field(init=False)
    kv_blocks_total: Gauge = field(init=False)
    prefix_queried: Gauge = field(init=False)
    prefix_hits: Gauge = field(init=False)
    preemptions: Gauge = field(init=False)
    spec_proposed: Gauge = field(init=False)
    spec_accepted: Gauge = field(init=False)
    spec_verifications: Gauge = field(init=False)

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
        self.waiting = Gauge("kvyard_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("kvyard_num_requests_running", "Requests being processed", registry=r)
        self.kv_blocks_used = Gauge("kvyard_kv_blocks_used", "KV blocks referenced by requests", registry=r)
        self.kv_blocks_total = Gauge("kvyard_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.prefix_queried = Gauge("kvyard_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache "
                                    "(total since start)", registry=r)  # fmt: skip
        self.prefix_hits = Gauge("kvyard_prefix_cache_hit_tokens", "Tokens found in the prefix cache (total since "
                                 "start)", registry=r)  # fmt: skip
        self.preemptions = Gauge("kvyard_num_preemptions", "Requests preempted (total since start)", registry=r)
        self.spec_proposed = Gauge(SPEC_PROPOSED, "Speculative decoding: tokens proposed and "
                                   "verified (total since start)", registry=r)  # fmt: skip
        self.spec_accepted = Gauge(SPEC_ACCEPTED, "Speculative decoding: proposed tokens the model "
                                   "agreed with, each a decode step saved (total since start)", registry=r)  # fmt: skip
        self.spec_verifications = Gauge(SPEC_VERIFICATIONS, "Speculative decoding: steps of a request that verified "
                                        "proposals; accepted tokens / this is the mean accepted run (total since "
                                        "start)", registry=r)  # fmt: skip

    def refresh(self, stats: EngineCounters) -> None:
        """Set the gauges from the engine's statistics (at scrape time)."""
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.prefix_queried.set(stats.prefix_cache_queried_tokens)
        self.prefix_hits.set(stats.prefix_cache_hit_tokens)
        self.preemptions.set(stats.num_preemptions)
        self.spec_proposed.set(stats.spec_proposed_tokens)
        self.spec_accepted.set(stats.spec_accepted_tokens)
        self.spec_verifications.set(stats.spec_verifications)

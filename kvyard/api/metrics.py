"""Prometheus metrics of one replica, in a registry owned by the app (no global state): the names every
replica exports, real or simulated, each labelled with the served model's name (`model_name`, as vLLM's are), and
how clients read them off a replica's /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
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
# The label every metric of a replica carries: the model it serves, as its /v1/models names it, so the series of
# fleets serving different models stay apart when one Prometheus scrapes them all.
MODEL_NAME = "model_name"

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
    (
        "spec_accepted_tokens",
        SPEC_ACCEPTED,
        "Speculative decoding: proposed tokens the model agreed with, each a decode step saved",
    ),
    (
        "spec_verifications",
        SPEC_VERIFICATIONS,
        "Speculative decoding: steps of a request that verified proposals; "
        "accepted tokens / this is the mean accepted run",
    ),
)
_ENGINE_GAUGES = (
    ("num_waiting", "kvyard_num_requests_waiting", "Requests waiting to be scheduled"),
    ("num_running", "kvyard_num_requests_running", "Requests being processed"),
    ("kv_blocks_used", "kvyard_kv_blocks_used", "KV blocks referenced by requests"),
    ("kv_blocks_total", "kvyard_kv_blocks_total", "KV blocks in the pool"),
)


def counter_family(name: str, documentation: str, model_name: str, value: float) -> CounterMetricFamily:
    """One counter of the replica serving `model_name` (`_total` added), for a collector read at scrape time."""
    family = CounterMetricFamily(name, documentation, labels=[MODEL_NAME])
    family.add_metric([model_name], value)
    return family


def gauge_family(name: str, documentation: str, model_name: str, value: float) -> GaugeMetricFamily:
    """One gauge of the replica serving `model_name`, for a collector read at scrape time."""
    family = GaugeMetricFamily(name, documentation, labels=[MODEL_NAME])
    family.add_metric([model_name], value)
    return family


def sample_sum(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` of a /metrics page whose labels include `labels`: a total over the models
    (`model_name`) and any other label the page has; a replica older than the label is read alike."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


class EngineCollector(Collector):
    """The engine's statistics, read when /metrics is scraped (nothing when no engine has loaded yet)."""

    def __init__(self, stats: Callable[[], EngineCounters | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.stats()
        if stats is None:
            return
        for attribute, name, documentation in _ENGINE_TOTALS:
            yield counter_family(name, documentation, self.model_name, getattr(stats, attribute))
        for attribute, name, documentation in _ENGINE_GAUGES:
            yield gauge_family(name, documentation, self.model_name, getattr(stats, attribute))


@dataclass(frozen=True, slots=True)
class OutcomeCounter:
    """Finished requests of one model by outcome: `labels(outcome=...)` as on the Counter, the model bound."""

    counter: Counter
    model_name: str

    def labels(self, outcome: str) -> Counter:
        return self.counter.labels(model_name=self.model_name, outcome=outcome)


@dataclass(slots=True)
class ServerMetrics:
    """The metrics of a replica serving `model_name`, every one labelled with it (the labels bound here, so callers
    observe and count as on unlabelled metrics). `engine_stats`: what the engine counts (None before it has
    loaded)."""

    model_name: str
    engine_stats: Callable[[], EngineCounters | None] = lambda: None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ttft: Histogram = field(init=False)
    inter_token: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    requests: OutcomeCounter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generation_tokens: Counter = field(init=False)
    cached_prompt_tokens: Counter = field(init=False)

    def __post_init__(self) -> None:
        r, model = self.registry, self.model_name
        self.ttft = _latency("kvyard_time_to_first_token_seconds", "Time to first token", r).labels(model_name=model)
        self.inter_token = _latency("kvyard_inter_token_latency_seconds", "Time between output tokens", r).labels(
            model_name=model
        )
        self.e2e = _latency("kvyard_e2e_request_latency_seconds", "End-to-end request latency", r).labels(
            model_name=model
        )
        self.requests = OutcomeCounter(
            Counter(REQUESTS, "Finished requests by outcome", [MODEL_NAME, "outcome"], registry=r), model
        )
        self.prompt_tokens = Counter(
            PROMPT_TOKENS, "Prompt tokens of finished requests", [MODEL_NAME], registry=r
        ).labels(model_name=model)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Generated tokens", [MODEL_NAME], registry=r).labels(
            model_name=model
        )
        self.cached_prompt_tokens = Counter(
            CACHED_PROMPT_TOKENS,
            "Prompt tokens served from the prefix cache, as reported in usage",
            [MODEL_NAME],
            registry=r,
        ).labels(model_name=model)
        r.register(EngineCollector(self.engine_stats, model))


def _latency(name: str, documentation: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(name, documentation, [MODEL_NAME], registry=registry, buckets=_LATENCY_BUCKETS)

"""Prometheus metrics of the router, in a registry owned by the app (no global state). Unlike a replica's they carry
no `model_name`: one router fronts every model of its fleet, and each metric is about the router itself or one
replica (whose own metrics name its models), never about one model."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """The labelled children of one replica, looked up once instead of per request."""

    routed: Counter
    predicted_cached: Counter
    reported_cached: Counter
    cached_error: Counter
    prompt_tokens: Counter
    predicted_by_source: dict[str, Counter]
    reported_by_source: dict[str, Counter]
    error_by_source: dict[str, Counter]


SOURCES = ("device", "local", "shared")


@dataclass(slots=True)
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    routed: Counter = field(init=False)
    predicted_cached: Counter = field(init=False)
    reported_cached: Counter = field(init=False)
    cached_error: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    predicted_by_source: Counter = field(init=False)
    reported_by_source: Counter = field(init=False)
    error_by_source: Counter = field(init=False)
    decision_latency: Histogram = field(init=False)
    retries: Counter = field(init=False)
    ejections: Counter = field(init=False)
    resyncs: Counter = field(init=False)
    rejected: Counter = field(init=False)
    in_flight: Gauge = field(init=False)
    healthy: Gauge = field(init=False)
    panic: Gauge = field(init=False)
    pd_routes: Counter = field(init=False)
    pd_prefills: Counter = field(init=False)
    _replicas: dict[str, ReplicaMetrics] = field(default_factory=dict)

    def __post_init__(self) -> None:
        r = self.registry
        self.routed = Counter("kvyard_router_routed_requests", "Requests sent to each replica", ["replica"], registry=r)
        self.predicted_cached = Counter(
            "kvyard_router_predicted_cached_tokens",
            "Prompt tokens the router predicted the replica had cached (for requests whose usage came back)",
            ["replica"],
            registry=r,
        )
        self.reported_cached = Counter(
            "kvyard_router_reported_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens as reported by the replica",
            ["replica"],
            registry=r,
        )
        self.cached_error = Counter(
            "kvyard_router_cached_tokens_error",
            "Sum over requests of |predicted - reported| cached prompt tokens "
            "(every source together; 0 when the router's index is exact)",
            ["replica"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvyard_router_prompt_tokens", "usage.prompt_tokens as reported by the replica", ["replica"], registry=r
        )
        # docs/contracts.md §7: parity by where the cached tokens come from, and an error per request that
        # over- and under-predictions cannot cancel in.
        by_source = ["replica", "source"]
        self.predicted_by_source = Counter(
            "kvyard_router_predicted_cached_tokens_by_source",
            "Predicted cached prompt tokens, by source (device, "
            "local tiers, shared store), for requests whose usage says where its cached tokens came from",
            by_source,
            registry=r,
        )
        self.reported_by_source = Counter(
            "kvyard_router_reported_cached_tokens_by_source",
            "usage.prompt_tokens_details.cached_tokens_by_source as reported by the replica",
            by_source,
            registry=r,
        )
        self.error_by_source = Counter(
            "kvyard_router_cached_tokens_abs_error",
            "Sum over requests of |predicted - reported| cached prompt tokens, by source",
            by_source,
            registry=r,
        )
        self.decision_latency = Histogram(
            "kvyard_router_decision_seconds",
            "Time to pick a replica (tokens, keys, scoring)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.retries = Counter("kvyard_router_retries", "Requests retried on another replica", ["reason"], registry=r)
        self.ejections = Counter("kvyard_router_ejections", "Replicas ejected", ["replica", "reason"], registry=r)
        self.resyncs = Counter(
            "kvyard_router_index_resyncs",
            "Cache-index rebuilds, by reason: a kvyard replica's /kv/snapshot loaded "
            "again, or a vLLM or SGLang replica's events replayed or started over",
            ["replica", "reason"],
            registry=r,
        )
        self.rejected = Counter(
            "kvyard_router_rejected", "Requests answered 429/503 by the router", ["reason"], registry=r
        )
        self.in_flight = Gauge("kvyard_router_in_flight_requests", "Requests being proxied", registry=r)
        self.healthy = Gauge("kvyard_router_healthy_replicas", "Replicas passing their health checks", registry=r)
        self.panic = Gauge(
            "kvyard_router_panic",
            "1 while too few replicas are healthy (--panic-threshold) and ejected ones receive requests too",
            registry=r,
        )
        self.pd_routes = Counter(
            "kvyard_router_pd_requests",
            "Requests routed with prefill/decode replicas, by how: "
            "remote (a prefill replica prefilled), short, prefill_busy or no_prefill_replica "
            "(the decode replica prefilled), decode_full (a prefill replica ran it whole)",
            ["path"],
            registry=r,
        )
        self.pd_prefills = Counter(
            "kvyard_router_pd_prefill_legs",
            "Prefill legs, by outcome (ok, status_N, connect, broken)",
            ["outcome"],
            registry=r,
        )

    def replica(self, url: str) -> ReplicaMetrics:
        children = self._replicas.get(url)
        if children is None:
            children = self._replicas[url] = ReplicaMetrics(
                self.routed.labels(url),
                self.predicted_cached.labels(url),
                self.reported_cached.labels(url),
                self.cached_error.labels(url),
                self.prompt_tokens.labels(url),
                {source: self.predicted_by_source.labels(url, source) for source in SOURCES},
                {source: self.reported_by_source.labels(url, source) for source in SOURCES},
                {source: self.error_by_source.labels(url, source) for source in SOURCES},
            )
        return children

"""Prometheus view of the paged experts' cache (kvyard.models.expert_residency), read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvyard.api.metrics import counter_family, gauge_family

if TYPE_CHECKING:  # the server imports no model code (nor torch) to read it
    from kvyard.engine.llm_engine import ResidencySnapshot

_GAUGES = (
    ("budget_bytes", "kvyard_expert_cache_budget_bytes", "Memory the weights budget leaves for routed experts"),
    ("resident_bytes", "kvyard_expert_cache_resident_bytes", "Routed experts' weights in memory (or being read)"),
    ("resident_experts", "kvyard_expert_cache_resident_experts", "Routed experts in memory"),
    ("experts", "kvyard_expert_cache_experts", "Routed experts of the model, in memory or not"),
)
_COUNTERS = (
    ("hits", "kvyard_expert_cache_hits", "Expert uses that found it in memory or already being read"),
    ("misses", "kvyard_expert_cache_misses", "Expert uses that read it from disk then"),
    ("prefetches", "kvyard_expert_cache_prefetches", "Experts read ahead of their use"),
    ("prefetch_hits", "kvyard_expert_cache_prefetch_hits", "Expert uses served by a read ahead"),
    ("late_prefetches", "kvyard_expert_cache_late_prefetches", "Expert uses that waited for their read ahead"),
    ("evictions", "kvyard_expert_cache_evictions", "Experts dropped from memory to stay within the budget"),
    ("read_bytes", "kvyard_expert_cache_read_bytes", "Bytes of expert weights read from disk"),
    ("read_seconds", "kvyard_expert_cache_read_seconds", "Time spent reading expert weights, on any thread"),
    ("wait_seconds", "kvyard_expert_cache_wait_seconds", "Time the forward pass waited for expert reads"),
)


class ExpertCacheCollector(Collector):
    def __init__(self, snapshot: Callable[[], ResidencySnapshot | None], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = self.snapshot()
        if snap is None:
            return
        for attribute, name, documentation in _GAUGES:
            yield gauge_family(name, documentation, self.model_name, getattr(snap, attribute))
        for attribute, name, documentation in _COUNTERS:
            yield counter_family(name, documentation, self.model_name, getattr(snap, attribute))

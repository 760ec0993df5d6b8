"""Prometheus view of the KV tier's counters (kvyard.kvcache.stats), read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from kvyard.kvcache.stats import StoreSnapshot

_TIER_COUNTERS = (
    ("hits", "kvyard_kv_tier_hits", "Blocks served by the tier"),
    ("misses", "kvyard_kv_tier_misses", "Lookups that ended in the tier with the wanted prefix incomplete"),
    ("bytes_read", "kvyard_kv_tier_read_bytes", "Bytes read from the tier"),
    ("bytes_written", "kvyard_kv_tier_written_bytes", "Bytes written to the tier"),
    ("blocks_written", "kvyard_kv_tier_written_blocks", "Blocks written to the tier"),
    ("corrupt", "kvyard_kv_tier_corrupt_blocks", "Blocks dropped because their bytes failed verification"),
    ("mismatched", "kvyard_kv_tier_mismatched_blocks", "Blocks dropped because they belong to another namespace"),
    ("errors", "kvyard_kv_tier_errors", "Failed tier operations (I/O errors, unreachable server, timeouts)"),
    ("evictions", "kvyard_kv_tier_evicted_blocks", "Blocks evicted to stay within the tier's budget"),
)


class KVTierCollector(Collector):
    def __init__(self, snapshot: Callable[[], StoreSnapshot | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        snap = self.snapshot()
        if snap is None:
            return
        for attribute, name, documentation in _TIER_COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=["tier"])
            for tier, counters in snap.tiers.items():
                family.add_metric([tier], getattr(counters, attribute))
            yield family
        load = SummaryMetricFamily("kvyard_kv_tier_load_seconds", "Time of one lookup in the tier", labels=["tier"])
        store = SummaryMetricFamily("kvyard_kv_tier_store_seconds", "Time of one batched write to the tier",
                                    labels=["tier"])  # fmt: skip
        for tier, counters in snap.tiers.items():
            load.add_metric([tier], counters.loads, counters.load_seconds)
            store.add_metric([tier], counters.stores, counters.store_seconds)
        yield load
        yield store
        yield GaugeMetricFamily("kvyard_kv_tier_queue_blocks", "Blocks waiting to be written", value=snap.queue_blocks)
        yield GaugeMetricFamily("kvyard_kv_tier_queue_bytes", "Bytes waiting to be written", value=snap.queue_bytes)
        yield CounterMetricFamily("kvyard_kv_tier_queue_dropped_blocks", "Blocks not written because the write "
                                  "queue was full", value=snap.queue_dropped_blocks)  # fmt: skip
        yield CounterMetricFamily("kvyard_kv_tier_loaded_blocks", "Blocks loaded from the tier into the device "
                                  "cache", value=snap.loaded_blocks)  # fmt: skip

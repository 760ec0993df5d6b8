"""Prometheus views of the KV tier's counters (kvyard.kvcache.stats) and of KV transfers, read at scrape time, each
labelled with the model the replica serves (kvyard.api.metrics.MODEL_NAME)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from kvyard.api.metrics import MODEL_NAME, counter_family, gauge_family
from kvyard.engine.kv_links.exports import KVExports
from kvyard.engine.kv_links.pull_link import PullCounters
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
    def __init__(self, snapshot: Callable[[], StoreSnapshot | None], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        snap = self.snapshot()
        if snap is None:
            return
        model, by_tier = self.model_name, [MODEL_NAME, "tier"]
        for attribute, name, documentation in _TIER_COUNTERS:
            family = CounterMetricFamily(name, documentation, labels=by_tier)
            for tier, counters in snap.tiers.items():
                family.add_metric([model, tier], getattr(counters, attribute))
            yield family
        load = SummaryMetricFamily("kvyard_kv_tier_load_seconds", "Time of one lookup in the tier", labels=by_tier)
        store = SummaryMetricFamily(
            "kvyard_kv_tier_store_seconds", "Time of one batched write to the tier", labels=by_tier
        )
        for tier, counters in snap.tiers.items():
            load.add_metric([model, tier], counters.loads, counters.load_seconds)
            store.add_metric([model, tier], counters.stores, counters.store_seconds)
        yield load
        yield store
        yield gauge_family("kvyard_kv_tier_queue_blocks", "Blocks waiting to be written", model, snap.queue_blocks)
        yield gauge_family("kvyard_kv_tier_queue_bytes", "Bytes waiting to be written", model, snap.queue_bytes)
        yield counter_family(
            "kvyard_kv_tier_queue_dropped_blocks",
            "Blocks not written because the write queue was full",
            model,
            snap.queue_dropped_blocks,
        )
        yield counter_family(
            "kvyard_kv_tier_loaded_blocks",
            "Blocks loaded from the tier into the device cache",
            model,
            snap.loaded_blocks,
        )


_EXPORT_COUNTERS = (
    ("exports", "kvyard_kv_transfer_exports", "Requests prefilled here for a decode replica"),
    ("blocks_exported", "kvyard_kv_transfer_exported_blocks", "Blocks pinned for decode replicas to pull"),
    ("released", "kvyard_kv_transfer_leases_released", "Transfers released by their decode replica"),
    ("expired", "kvyard_kv_transfer_leases_expired", "Transfers whose lease ran out before a release"),
    ("failed", "kvyard_kv_transfer_exports_failed", "Transfers ended early: request aborted or lease cap reached"),
)


class KVTransferCollector(Collector):
    """Both sides of prefill/decode transfers: leases held here, pulls made from here."""

    def __init__(
        self, exports: Callable[[], KVExports], pulls: Callable[[], PullCounters | None], model_name: str
    ) -> None:
        self.exports = exports
        self.pulls = pulls
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        exports, model = self.exports(), self.model_name
        for attribute, name, documentation in _EXPORT_COUNTERS:
            yield counter_family(name, documentation, model, getattr(exports.counters, attribute))
        yield gauge_family(
            "kvyard_kv_transfer_leased_blocks", "Blocks pinned for transfers now", model, exports.num_pinned_blocks
        )
        yield gauge_family(
            "kvyard_kv_transfer_active_leases", "Transfers holding a lease now", model, exports.num_active
        )
        pulls = self.pulls()
        if pulls is None:
            return
        yield counter_family("kvyard_kv_transfer_pulls", "Transfers pulled from prefill replicas", model, pulls.pulls)
        yield counter_family(
            "kvyard_kv_transfer_pulls_complete", "Pulls that brought every block asked for", model, pulls.complete
        )
        yield counter_family("kvyard_kv_transfer_pulled_blocks", "Blocks pulled and verified", model, pulls.blocks)
        yield counter_family("kvyard_kv_transfer_pulled_bytes", "Bytes of pulled blocks", model, pulls.bytes)
        yield counter_family(
            "kvyard_kv_transfer_pull_seconds", "Time spent pulling, waiting for prefill included", model, pulls.seconds
        )
        fallbacks = CounterMetricFamily(
            "kvyard_kv_transfer_fallbacks",
            "Pulls that fell short (the rest was computed here), by reason",
            labels=[MODEL_NAME, "reason"],
        )
        for reason, count in sorted(pulls.fallbacks.items()):
            fallbacks.add_metric([model, reason], count)
        yield fallbacks

"""What the connector tells a router through vLLM's own `/metrics`: which shared store the replica loads from, and
what a block loaded from each of its tier media costs.

vLLM carries a connector's stats from its worker to the API server (`KVConnectorStats`), which hands them to the
connector's Prometheus metrics (`build_prom_metrics`). kvyard's router reads:

- `vllm:kvyard_shared_store_info{store, ttl_s}` = 1: the shared store's id (it changes when the store is flushed or
  restarted) and its blocks' expiry. A replica that has not served a request yet is already a member: the API server
  reads the store's id once at start; later changes come from the worker, whose writer looks at the store when idle.
- `vllm:kvyard_tier_load_seconds_total{medium}` and `vllm:kvyard_tier_loaded_blocks_total{medium}` (`local`: the
  replica's memory and disk tiers; `shared`: the store): the router's seconds per loaded block, as kvyard's own
  replicas report theirs in `/load`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvyard.integrations.connector_config import connector_config
from kvyard.kvcache.config import KVTierConfig

MEDIA = ("local", "shared")
STORE_INFO = "vllm:kvyard_shared_store_info"
LOAD_SECONDS = "vllm:kvyard_tier_load_seconds_total"
LOADED_BLOCKS = "vllm:kvyard_tier_loaded_blocks_total"


@dataclass
class KvyardConnectorStats(KVConnectorStats):
    """`data`: {"load_seconds": {medium: s}, "loaded_blocks": {medium: n}} since the last report, and the shared
    store ({"shared_store": id, "shared_ttl_s": s}) when the worker saw a new one."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = {**self.data, **{key: value for key, value in other.data.items() if not isinstance(value, dict)}}
        for key in ("load_seconds", "loaded_blocks"):
            mine, theirs = self.data.get(key, {}), other.data.get(key, {})
            if mine or theirs:
                merged[key] = {medium: mine.get(medium, 0) + theirs.get(medium, 0) for medium in {*mine, *theirs}}
        return KvyardConnectorStats(merged)

    def reduce(self) -> dict[str, int | float]:
        loaded, seconds = self.data.get("loaded_blocks", {}), self.data.get("load_seconds", {})
        summary: dict[str, int | float] = {}
        for medium, blocks in loaded.items():
            summary[f"{medium}_blocks_loaded"] = blocks
            if blocks:
                summary[f"{medium}_ms_per_block"] = round(1e3 * seconds.get(medium, 0.0) / blocks, 3)
        return summary

    def is_empty(self) -> bool:
        """Nothing loaded, no time spent on loads (a load that timed out brought nothing but took time), no store."""
        loads = (*self.data.get("loaded_blocks", {}).values(), *self.data.get("load_seconds", {}).values())
        return not any(loads) and "shared_store" not in self.data


def load_stats(totals: dict[str, tuple[float, int]], reported: dict[str, tuple[float, int]]) -> KvyardConnectorStats:
    """The loads since `reported` (cumulative totals by medium, updated to `totals`), as stats."""
    seconds: dict[str, float] = {}
    blocks: dict[str, int] = {}
    for medium, (total_s, total_blocks) in totals.items():
        before_s, before_blocks = reported.get(medium, (0.0, 0))
        if total_blocks > before_blocks or total_s > before_s:
            seconds[medium], blocks[medium] = total_s - before_s, total_blocks - before_blocks
            reported[medium] = (total_s, total_blocks)
    return KvyardConnectorStats({"load_seconds": seconds, "loaded_blocks": blocks} if blocks else {})


def store_stats(store_id: str, ttl_s: float | None) -> KvyardConnectorStats:
    return KvyardConnectorStats({"shared_store": store_id, "shared_ttl_s": ttl_s})


def current_store_id(tier: KVTierConfig) -> str | None:
    """The shared store's id as it is now (None: no shared tier, or it did not answer)."""
    if "redis" not in tier.active_tiers or tier.redis_url is None:
        return None
    from kvyard.kvcache.redis_tier import RedisTier

    store = RedisTier(tier.redis_url, tier.redis_ttl_s, tier.redis_cluster, timeout_s=tier.redis_timeout_s)
    try:
        return store.store_id
    finally:
        store.close()


class KvyardPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._store_info = self._gauge_cls(
            name=STORE_INFO,
            documentation="The shared KV store the kvyard connector loads from (1): its id and its blocks' expiry",
            labelnames=[*labelnames, "store", "ttl_s"],
            multiprocess_mode="mostrecent",
        )
        self._load_seconds = self._counter_cls(
            name=LOAD_SECONDS,
            documentation="Seconds the kvyard connector spent loading blocks, by tier medium (local, shared)",
            labelnames=[*labelnames, "medium"],
        )
        self._loaded_blocks = self._counter_cls(
            name=LOADED_BLOCKS,
            documentation="Blocks the kvyard connector loaded, by tier medium (local, shared)",
            labelnames=[*labelnames, "medium"],
        )
        self._stores: dict[int, tuple[str, str]] = {}
        config = connector_config(vllm_config.kv_transfer_config.kv_connector_extra_config).tier
        ttl = str(config.redis_ttl_s)
        store_id = current_store_id(config)  # None while the store is down: the worker reports it later
        for engine in per_engine_labelvalues:
            for medium in MEDIA:  # zero from the start, so a scrape tells "no loads yet" from "no connector"
                self._load_seconds.labels(*per_engine_labelvalues[engine], medium)
                self._loaded_blocks.labels(*per_engine_labelvalues[engine], medium)
            if store_id is not None:
                self._set_store(engine, store_id, ttl)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for medium, seconds in transfer_stats_data.get("load_seconds", {}).items():
            self._load_seconds.labels(*labels, medium).inc(seconds)
        for medium, blocks in transfer_stats_data.get("loaded_blocks", {}).items():
            self._loaded_blocks.labels(*labels, medium).inc(blocks)
        store_id = transfer_stats_data.get("shared_store")
        if store_id is not None:
            ttl = transfer_stats_data.get("shared_ttl_s")
            self._set_store(engine_idx, str(store_id), str(ttl if ttl is not None else ""))

    def _set_store(self, engine_idx: int, store_id: str, ttl: str) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        previous = self._stores.get(engine_idx)
        if previous == (store_id, ttl):
            return
        if previous is not None:
            with contextlib.suppress(KeyError):
                self._store_info.remove(*labels, *previous)
        self._store_info.labels(*labels, store_id, ttl).set(1)
        self._stores[engine_idx] = (store_id, ttl)

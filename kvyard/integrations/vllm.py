"""kvyard's KV tier inside vLLM: a v1 KV connector that keeps vLLM's KV across restarts, machines and replicas.

vLLM loads it by path:

    --kv-transfer-config '{"kv_connector": "KvyardConnector", "kv_connector_module_path": "kvyard.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": "memory,disk,redis", "redis_url": "redis://127.0.0.1:6379/0"}}'

The scheduler half (`block_plan`) offers a new request the leading blocks the tiers hold past vLLM's own prefix
cache and plans, each step, which blocks to load and which newly computed ones to save. The worker half copies
them between vLLM's paged KV cache and kvyard's tiered store (`paged_blocks`): loads run before the step's forward
and every block is checked (CRC, namespace, key, format) as kvyard's own engine checks it; saves are copied out of
the cache at the end of the step and written behind it by the store's writer thread. A block that does not arrive
is reported to vLLM, which computes it instead (with `kv_load_failure_policy: recompute`; vLLM's default, `fail`,
fails the request). One engine process with one KV cache group (tensor and pipeline parallel size 1, no hybrid
attention); multimodal requests are neither loaded nor saved.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvyard.integrations.block_plan import BlockPlanner, ScheduledRequest, StepPlan
from kvyard.integrations.connector_config import connector_config
from kvyard.integrations.paged_blocks import PagedBlocks
from kvyard.integrations.tier_presence import Source, TierPresence
from kvyard.integrations.vllm_events import TierEvents
from kvyard.integrations.vllm_metrics import KvyardConnectorStats, KvyardPromMetrics, load_stats, store_stats
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.tiered_store import BlockWrite, TieredStore
from kvyard.models.checkpoint import model_digest

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvyard")  # under vLLM's logger, so its handlers print it
MAX_UNWRITTEN = 1 << 16
PREFILL_POLL_S = 0.005  # how often a disaggregated request looks for its prefill replica's blocks

_HIT_SOURCES: dict[Source, CacheHitSource] = {
    "memory": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "redis": CacheHitSource.EXTERNAL_UNSPECIFIED,
}


@dataclass(slots=True)
class PrefillWait:
    """A disaggregated request waiting for the prefill replica's blocks to reach the tier."""

    deadline: float
    next_look: float = 0.0
    over: bool = False


class KvyardStepMeta(KVConnectorMetadata):
    """Scheduler -> worker: this step's loads and saves."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class KvyardWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: what the worker's own tiers gained and lost this step (`snapshot`: all they hold),
    blocks a load did not find, and what the writer put into (or saw leave) the shared store."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    snapshot: bool = False
    missing: list[bytes] = field(default_factory=list)
    shared_stored: list[bytes] = field(default_factory=list)
    shared_removed: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvyardWorkerMeta):
            return self
        first = other if other.snapshot else self
        return KvyardWorkerMeta(
            first.stored + (other.stored if first is self else []),
            first.removed + (other.removed if first is self else []),
            first.snapshot,
            self.missing + other.missing,
            self.shared_stored + other.shared_stored,
            self.shared_removed + other.shared_removed,
        )

    def has_news(self) -> bool:
        return bool(
            self.stored or self.removed or self.snapshot or self.missing or self.shared_stored or self.shared_removed
        )


def vllm_namespace(vllm_config: VllmConfig) -> KeyNamespace:
    """The block-key namespace of a vLLM engine: its weights, what its KV values depend on, and its block size.

    The device type is in it because vLLM's KV layout differs by backend, so a CPU and a GPU replica sharing a store
    never take each other's blocks (nor kvyard's own engine's, whose layout is its own)."""
    model = vllm_config.model_config
    model_dir = Path(model.model)
    digest = model_digest(model_dir) if (model_dir / "config.json").is_file() else f"{model.model}@{model.revision}"
    dtype = ":".join(
        (
            f"vllm-{vllm_config.device_config.device_type}",
            str(model.dtype).removeprefix("torch."),
            str(vllm_config.cache_config.cache_dtype),
        )
    )
    return KeyNamespace(model_dir.name, digest, dtype, vllm_config.cache_config.block_size)


class KvyardConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("the kvyard connector runs with tensor and pipeline parallel size 1")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("the kvyard connector supports models with one KV cache group (no hybrid attention)")
        transfer = self._kv_transfer_config
        config = connector_config(transfer.kv_connector_extra_config)
        if config.ignored:
            log.warning("kvyard connector: ignoring unknown kv_connector_extra_config keys %s", list(config.ignored))
        self._tier_config = config.tier
        self._remote_prefill_wait_s = config.remote_prefill_wait_s
        self._writer_cpus = config.writer_cpus
        self._namespace = vllm_namespace(vllm_config)
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(transfer.is_kv_consumer, transfer.is_kv_producer)
            if transfer.kv_load_failure_policy != "recompute":
                policy = transfer.kv_load_failure_policy
                log.warning(
                    "kvyard connector: kv_load_failure_policy is %r, so a tier block that fails to load "
                    "fails its request; 'recompute' computes it instead",
                    policy,
                )
        else:
            self._init_worker()

    # ------------------------------------------------------------------ scheduler side

    def _init_scheduler(self, load: bool, save: bool) -> None:
        shared = None
        if "redis" in self._tier_config.active_tiers:
            from kvyard.kvcache.redis_tier import RedisTier

            tier = self._tier_config
            assert tier.redis_url is not None
            shared = RedisTier(tier.redis_url, tier.redis_ttl_s, tier.redis_cluster, timeout_s=tier.redis_timeout_s)
        self._presence = TierPresence(self._tier_config, shared)
        self._planner = BlockPlanner(self._namespace, self._presence, load=load, save=save)
        events = self._vllm_config.kv_events_config
        # Only when vLLM publishes KV events: naming each block as vLLM's events do costs a hash lookup per block.
        publish = events is not None and events.enable_kv_cache_events
        block_size = self._namespace.block_size
        local = bool({"memory", "disk"} & set(self._tier_config.active_tiers))
        self._tier_events = TierEvents(block_size, local, shared is not None) if publish else None
        self._requests: dict[str, Request] = {}
        self._prefill_waits: dict[str, PrefillWait] = {}
        self._idle = False  # the last step scheduled nothing
        log.info("kvyard connector: %s, namespace %s", self._tier_config.describe(), self._namespace)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.prompt_token_ids is None or request.mm_features:
            return 0, False
        self._requests[request.request_id] = request
        wait = self._prefill_wait(request)
        if wait is not None and (pause := wait.next_look - time.monotonic()) > 0:
            if not self._idle:
                return None, False
            # Nothing else to run: vLLM would ask again at once, a busy loop that takes the CPU the prefill
            # replica's writer may need. Sleep until it is time to look.
            time.sleep(pause)
        salt = request.cache_salt or ""
        if request.lora_request is not None:
            salt += f"\x00lora:{request.lora_request.lora_name}"
        tokens = self._planner.matched_tokens(request.request_id, salt, request.all_token_ids, num_computed_tokens)
        if wait is not None and self._still_waiting(request, wait, num_computed_tokens + tokens):
            return None, False
        return tokens, False

    def _prefill_wait(self, request: Request) -> PrefillWait | None:
        """The wait of a request the router disaggregated (`do_remote_prefill`), until it is over."""
        params = request.kv_transfer_params
        if not self._planner.load_enabled or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        wait = self._prefill_waits.get(request.request_id)
        if wait is None:
            wait = self._prefill_waits[request.request_id] = PrefillWait(time.monotonic() + self._remote_prefill_wait_s)
        return None if wait.over else wait

    def _still_waiting(self, request: Request, wait: PrefillWait, available: int) -> bool:
        """Whether the prompt's full blocks are not all in the tier yet and the wait has time left."""
        block_size = self._planner.block_size
        wanted = (len(request.all_token_ids) - 1) // block_size * block_size
        now = time.monotonic()
        if available >= wanted or now >= wait.deadline:
            wait.over = True
            if available < wanted:
                log.warning(
                    "kvyard connector: request %s: %d of %d prompt tokens came from the prefill replica in "
                    "%.0f s; the rest is computed here",
                    request.request_id,
                    available,
                    wanted,
                    self._remote_prefill_wait_s,
                )
            return False
        wait.next_look = now + PREFILL_POLL_S
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._planner.allocated(request.request_id, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        counts = Counter(self._planner.sources(request.request_id, num_external_tokens))
        by_source = {_HIT_SOURCES[source]: blocks * self._planner.block_size for source, blocks in counts.items()}
        return (
            by_source
            if sum(by_source.values()) == num_external_tokens
            else super().get_external_cache_hit_sources(request, num_external_tokens)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._idle = scheduler_output.total_num_scheduled_tokens == 0
        scheduled = self._scheduled(scheduler_output)
        manager = self._kv_cache_manager
        assert manager is not None

        def token_ids_of(request_id: str) -> Sequence[int]:
            return self._requests[request_id].all_token_ids  # vLLM's read-only view, sliced, never copied whole

        def block_ids_of(request_id: str) -> list[int]:
            return manager.get_block_ids(request_id)[0]

        plan = self._planner.plan_step(scheduled, token_ids_of, block_ids_of)
        if self._tier_events is not None:
            for copy in plan.loads:
                self._tier_events.planned(self._requests[copy.request_id], zip(copy.block_indexes, copy.keys))
            for copy in plan.saves:
                request = self._requests[copy.request_id]
                self._tier_events.planned(request, zip(copy.block_indexes, copy.keys), saved=True)
        return KvyardStepMeta(plan)

    def _scheduled(self, output: SchedulerOutput) -> list[ScheduledRequest]:
        def after(request_id: str, computed: int) -> ScheduledRequest:
            speculative = len(output.scheduled_spec_decode_tokens.get(request_id, ()))
            return ScheduledRequest(request_id, computed + output.num_scheduled_tokens[request_id] - speculative)

        scheduled = [after(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        scheduled += [
            after(request_id, computed) for request_id, computed in zip(cached.req_ids, cached.num_computed_tokens)
        ]
        return [request for request in scheduled if request.request_id in self._requests]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, KvyardWorkerMeta):
            self._presence.apply(report.stored, report.removed + report.missing, report.snapshot)
            if self._tier_events is not None:
                self._tier_events.reported(report.stored, report.removed, report.snapshot)
                self._tier_events.reported_shared(report.shared_stored, report.shared_removed)

    def take_events(self) -> list[KVCacheEvent]:
        return self._tier_events.take() if self._tier_events is not None else []

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's: what its loads took, and the shared store's id when it changed. (Not the scheduler's: its
        view of the store's id is only as fresh as its last lookup, and vLLM lets the scheduler's stats override
        the worker's.)"""
        return self._worker_stats() if self._role != KVConnectorRole.SCHEDULER else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvyardConnectorStats(data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvyardPromMetrics:
        return KvyardPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._planner.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._prefill_waits.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def _init_worker(self) -> None:
        self._store: TieredStore | None = None
        self._blocks: PagedBlocks | None = None
        self._events = KVEventLog()
        self._events_seen = 0
        self._load_errors: set[int] = set()
        self._missing: list[bytes] = []  # keys a load did not find, for the scheduler to forget
        self._unwritten: set[bytes] = set()  # keys given to the writer since it was last seen idle
        self._reported_loads: dict[str, tuple[float, int]] = {}  # load totals by medium as last told to vLLM
        self._reported_store: str | None = None  # the shared store's id as last told to vLLM's metrics

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._blocks = PagedBlocks(kv_caches, self._num_blocks)
        self._store = self._tier_config.build(writer_cpus=self._writer_cpus)
        self._store.events = self._events
        log.info(
            "kvyard connector: %d layers, %s blocks of %d bytes; tiers %s",
            len(self._blocks.layers),
            self._blocks.format.dtype,
            self._blocks.block_bytes,
            self._tier_config.describe(),
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None or not plan.loads or self._store is None or self._blocks is None:
            return
        # A block saved moments ago may still be on its way to the tier: let the writer finish first.
        recent = any(key in self._unwritten for load in plan.loads for key in load.keys)
        if recent and self._store.flush(self._tier_config.load_deadline_s):
            self._unwritten.clear()
        for load in plan.loads:
            deadline = time.monotonic() + self._tier_config.load_deadline_s
            found = self._store.load_prefix(load.root_key, load.keys, self._blocks.format, deadline)
            self._blocks.write(load.block_ids[: len(found)], [block.payload for block in found])
            if len(found) < len(load.keys):
                self._load_errors.update(load.block_ids[len(found) :])
                self._missing.extend(load.keys[len(found) :])
                log.warning(
                    "kvyard connector: request %s: %d of %d blocks loaded, the rest is computed",
                    load.request_id,
                    len(found),
                    len(load.keys),
                )
            else:
                log.debug("kvyard connector: request %s: loaded %d blocks", load.request_id, len(found))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole blocks, every layer at once, in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or not plan.saves or self._store is None or self._blocks is None:
            return
        block_ids = [block_id for save in plan.saves for block_id in save.block_ids]
        frames = iter(self._blocks.read(block_ids))
        fmt = self._blocks.format
        writes = [BlockWrite(save.root_key, key, fmt, frame=next(frames)) for save in plan.saves for key in save.keys]
        self._store.submit(writes)
        if len(self._unwritten) > MAX_UNWRITTEN:
            self._unwritten.clear()  # only a wait before some load is lost: that load finds fewer blocks
        self._unwritten.update(write.key for write in writes)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._store is None:
            return None
        events, complete = self._events.events_since(self._events_seen)
        self._events_seen = self._events.last_seq
        missing, self._missing = self._missing, []
        if not complete:
            return KvyardWorkerMeta(self._store.local_keys(), [], snapshot=True, missing=missing)
        report = KvyardWorkerMeta(missing=missing)
        for event in events:
            if event.kind == "cleared":
                continue
            if event.medium == "local":
                (report.stored if event.kind == "stored" else report.removed).extend(event.block_keys)
            elif event.medium == "shared":
                (report.shared_stored if event.kind == "stored" else report.shared_removed).extend(event.block_keys)
        return report if report.has_news() else None

    def _worker_stats(self) -> KVConnectorStats | None:
        """What loads took since the last report, and the shared store's id when the writer saw it change (a
        flush or a restart, seen by the writer's idle look before any request asks the scheduler)."""
        if self._store is None:
            return None
        stats = load_stats(self._store.load_totals(), self._reported_loads)
        store = self._store.shared_store()
        if store is not None and store[0] != self._reported_store:
            self._reported_store = store[0]
            stats = stats.aggregate(store_stats(*store))
        return None if stats.is_empty() else stats

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvyardStepMeta) else None

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._presence.close()
        elif self._store is not None:
            self._store.close(timeout=10.0)

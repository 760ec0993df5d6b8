"""The replicas behind the router: add / drain / remove at run time, active health checks, ejection and
re-admission, and the tasks that keep each replica's load report and cache index current."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson
import zmq.asyncio

from kvyard.api.auth import ADMIN_KEY_HEADER, REPLICA_ADMIN_KEY_ENV, REPLICA_API_KEY_ENV
from kvyard.api.engine_kv_events import EventEndpoints
from kvyard.api.load import LoadReport
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.stats import RecentCost
from kvyard.net.http_client import HttpError, Response
from kvyard.router.cache_index import CacheIndex
from kvyard.router.config import RouterConfig
from kvyard.router.engine_index import EngineBlockKeys
from kvyard.router.engine_probe import (
    ENGINE_KINDS,
    KVYARD,
    OPENAI,
    EngineMetrics,
    kind_from_metrics,
    kind_from_owner,
)
from kvyard.router.engine_sync import EngineEventSync
from kvyard.router.holders import KeyHolders
from kvyard.router.kv_sync import KVSync
from kvyard.router.metrics import RouterMetrics
from kvyard.router.replica import ModelCard, Replica, State
from kvyard.router.tier_index import SharedStores
from kvyard.router.ttft_fit import TtftFit

_LOG = logging.getLogger(__name__)
# A vLLM or SGLang replica's Prometheus page is large (vLLM's: about 50 KB, 3 ms of its server's CPU to render):
# it is read this often at most; the health checks between two reads ask /health only.
ENGINE_METRICS_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class UpstreamAuth:
    """How the router identifies itself to replicas: its own API key, and the replicas' admin key."""

    api_headers: dict[str, str]
    admin_headers: dict[str, str]
    pd_headers: dict[str, str] = field(default_factory=dict)  # the admin key beside the API key (PD legs)

    @classmethod
    def from_config(cls, config: RouterConfig, environ: Mapping[str, str] = os.environ) -> UpstreamAuth:
        api_key = config.replica_api_key or environ.get(REPLICA_API_KEY_ENV)
        admin_key = config.replica_admin_key or environ.get(REPLICA_ADMIN_KEY_ENV)
        return cls.of_keys(api_key, admin_key)

    @classmethod
    def of_keys(cls, api_key: str | None, admin_key: str | None) -> UpstreamAuth:
        return cls(
            {"Authorization": f"Bearer {api_key}"} if api_key else {},
            {"Authorization": f"Bearer {admin_key}"} if admin_key else {},
            {ADMIN_KEY_HEADER: admin_key} if admin_key else {},
        )


@dataclass(slots=True)
class Registry:
    config: RouterConfig
    metrics: RouterMetrics
    upstream: UpstreamAuth = field(default_factory=lambda: UpstreamAuth({}, {}))
    replicas: dict[str, Replica] = field(default_factory=dict)
    shared_stores: SharedStores = field(default_factory=SharedStores)
    holders: KeyHolders = field(default_factory=KeyHolders)  # every replica's index, inverted
    _routable: list[Replica] | None = None  # the replicas routed to, kept until a state changes
    panicking: bool = False  # too few replicas are healthy: ejected ones are routed to too
    _tasks: dict[str, list[asyncio.Task[None]]] = field(default_factory=dict)
    _zmq: zmq.asyncio.Context | None = None  # for the KV events of vLLM and SGLang replicas, made on first use
    _warned: set[str] = field(default_factory=set)  # replicas whose missing load metrics were logged
    _speeds: dict[str, TtftFit] = field(default_factory=dict)  # one per engine: its replicas' samples pooled

    def __post_init__(self) -> None:
        self.shared_stores.max_keys = self.config.shared_index_keys

    def add(
        self, url: str, role: str | None = None, events: EventEndpoints | None = None, auth: UpstreamAuth | None = None
    ) -> Replica:
        """Route to `url`; `role` (prefill or decode) overrides the role the replica reports; `events` is where a
        vLLM or SGLang replica publishes its KV events; `auth`: the keys it is sent (default: the router's
        configured replica keys, for the replicas it was started with)."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        if url in self.replicas:
            replica = self.replicas[url]
            if replica.state is State.DRAINING:
                replica.state = State.HEALTHY
                self._refresh_gauge()
            replica.configured_role = role or replica.configured_role
            return replica
        index = CacheIndex(routed_capacity=self.config.approx_index_blocks, holders=self.holders)
        auth = auth or self.upstream
        replica = Replica(
            url,
            configured_role=role,
            index=index,
            connect_timeout_s=self.config.connect_timeout_s,
            api_headers=auth.api_headers,
            admin_headers=auth.admin_headers,
            pd_headers=auth.pd_headers,
            events=events,
        )
        index.owner = replica
        self.replicas[url] = replica
        # The index follows the replica's events once its health check has found what kind of server it is.
        self._tasks[url] = [asyncio.create_task(self._health_loop(replica), name=f"health {url}")]
        self._refresh_gauge()
        return replica

    def drain(self, url: str) -> Replica:
        replica = self._get(url)
        replica.state = State.DRAINING
        self._refresh_gauge()
        return replica

    async def remove(self, url: str) -> Replica:
        replica = self._get(url)
        replica.state = State.DRAINING
        del self.replicas[replica.url]
        self._refresh_gauge()  # before awaiting: no decision meanwhile may pick it from the cached routable list
        for task in self._tasks.pop(replica.url, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        replica.http.close()
        replica.index.forget_events()  # out of the fleet's key -> holders index
        self.holders.retire(replica)
        self._refresh_gauge()
        return replica

    async def close(self) -> None:
        for url in list(self.replicas):
            await self.remove(url)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)

    def routable(self) -> list[Replica]:
        """The replicas new requests go to (the same list until one changes state: do not change it): the healthy
        ones, or, while fewer than `panic_threshold` of the replicas not draining are healthy, all of those."""
        if self._routable is None:
            active = [replica for replica in self.replicas.values() if replica.state is not State.DRAINING]
            healthy = [replica for replica in active if replica.state is State.HEALTHY]
            self.panicking = len(healthy) < self.config.panic_threshold * len(active)
            self._routable = active if self.panicking else healthy
        return self._routable

    def healthy_count(self) -> int:
        return sum(replica.state is State.HEALTHY for replica in self.replicas.values())

    def report_failure(self, replica: Replica, reason: str) -> None:
        """A request could not reach the replica: eject it at once; health checks bring it back."""
        replica.consecutive_failures += 1
        self._eject(replica, reason)

    # ------------------------------------------------------------------ background work

    def _get(self, url: str) -> Replica:
        replica = self.replicas.get(url.rstrip("/"))
        if replica is None:
            raise KeyError(url)
        return replica

    def _eject(self, replica: Replica, reason: str) -> None:
        if replica.state is not State.HEALTHY:
            return
        replica.state = State.EJECTED
        replica.ejections += 1
        self.metrics.ejections.labels(replica.url, reason).inc()
        if not replica.index.has_events:
            replica.index.clear()  # it may come back empty, and no event stream would tell us
        _LOG.warning("ejected %s (%s)", replica.url, reason)
        self._refresh_gauge()

    def _readmit(self, replica: Replica) -> None:
        if replica.state is State.EJECTED:
            replica.state = State.HEALTHY
            _LOG.warning("re-admitted %s", replica.url)
            self._refresh_gauge()

    def _refresh_gauge(self) -> None:
        """Every change of state comes through here."""
        self._routable = None
        was_panicking = self.panicking
        self.routable()
        if self.panicking != was_panicking:
            _LOG.warning(
                "%s: %d of %d replicas healthy",
                "panic, routing to ejected replicas too" if self.panicking else "out of panic",
                self.healthy_count(),
                len(self.replicas),
            )
        self.metrics.healthy.set(self.healthy_count())
        self.metrics.panic.set(int(self.panicking))

    async def _health_loop(self, replica: Replica) -> None:
        timeout = self.config.health_timeout_s
        while True:
            try:
                if not replica.model_ids:
                    replica.model_cards = await self._model_cards(replica, timeout)
                    replica.model_ids = tuple(card.id for card in replica.model_cards)
                    replica.lora_ids = frozenset(card.id for card in replica.model_cards if card.parent)
                    self._refresh_gauge()  # the models it serves decide which requests it is a candidate for
                if not replica.kind:
                    replica.kind = await self._kind(replica, timeout)
                    # Replicas of one engine share a fit: one replica's few samples would make its own noisy, and a
                    # replica that looks slower gets fewer requests, so fewer samples to correct it.
                    replica.ttft = self._speeds.setdefault(replica.kind, TtftFit())
                    self._follow_index(replica)
                role = replica.role
                load = await self._load(replica, timeout)
                if load is not None:
                    replica.load = load
                    if replica.role != role:
                        self._refresh_gauge()  # lists of candidates carry roles (prefill/decode disaggregation)
                    replica.first_bytes_since_load = 0
                    replica.streaming_at_load = replica.streaming
                    replica.awaiting_at_load = replica.awaiting_first_byte
                replica.consecutive_failures = 0
                self._readmit(replica)
            except (HttpError, TimeoutError, ValueError, KeyError, TypeError) as error:
                replica.consecutive_failures += 1
                _LOG.debug("health check of %s failed: %s", replica.url, error)
                if replica.consecutive_failures >= self.config.eject_after_failures:
                    self._eject(replica, "health_check")
            await asyncio.sleep(self._health_interval_s())

    def _health_interval_s(self) -> float:
        """Each replica's interval: the configured one, longer when the whole fleet's checks would exceed the cap
        (spread by a random share, so replicas added together are not checked together)."""
        config = self.config
        interval = max(config.health_interval_s, len(self.replicas) / max(config.max_health_checks_per_s, 1e-3))
        return interval if interval == config.health_interval_s else interval * random.uniform(0.75, 1.25)

    async def _model_cards(self, replica: Replica, timeout: float) -> tuple[ModelCard, ...]:
        body = orjson.loads((await _get(replica, "/v1/models", timeout, replica.api_headers)).body)
        return tuple(ModelCard.from_json(card) for card in body["data"])

    async def _kind(self, replica: Replica, timeout: float) -> str:
        """What the replica is (engine_probe): what its models' owned_by says, else what it answers."""
        for card in replica.model_cards:
            kind = kind_from_owner(card.owned_by)
            if kind is not None:
                return kind
        load = await replica.http.request("GET", "/load", timeout=timeout, headers=replica.api_headers)
        if load.status == 200 and b'"num_waiting"' in load.body:
            return KVYARD  # kvyard's load report (vLLM's /load has only server_load)
        metrics = await replica.http.request("GET", "/metrics", timeout=timeout, headers=replica.api_headers)
        return kind_from_metrics(metrics.body.decode(errors="replace")) if metrics.status == 200 else OPENAI

    def _follow_index(self, replica: Replica) -> None:
        """Start keeping the replica's cache index: kvyard's over HTTP (/kv/events), vLLM's and SGLang's over ZMQ."""
        kind, events, url = replica.kind, replica.events, replica.url
        if kind == KVYARD:
            if events is not None:
                _LOG.warning("%s is a kvyard replica: its KV events come over HTTP, %s is not used", url, events)
            self._tasks[url].append(asyncio.create_task(self._kv_sync_loop(replica), name=f"kv-sync {url}"))
        elif kind in ENGINE_KINDS and events is not None:
            self._tasks[url].append(asyncio.create_task(self._engine_sync(replica, events), name=f"kv-events {url}"))
        else:
            _LOG.warning(
                "%s is a %s server without --replica-events: routed by its load and the prompts sent to it", url, kind
            )

    async def _engine_sync(self, replica: Replica, events: EventEndpoints) -> None:
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        # The block size is the metrics' (or, failing that, a placeholder the first event replaces).
        try:
            metrics = await self._engine_metrics(replica, self.config.health_timeout_s)
        except (HttpError, TimeoutError, ValueError) as error:
            _LOG.info("metrics of %s unread (%s): the block size is taken from its events", replica.url, error)
            metrics = EngineMetrics()
        self._join_shared_store(replica, metrics)

        def on_shared(kind: str, keys: list[bytes]) -> None:
            self.shared_stores.record(replica.shared_store_id, kind, keys)

        blocks = EngineBlockKeys(replica.index, engine_namespace(replica, metrics), on_shared=on_shared)
        await EngineEventSync(replica, events, self._zmq, self._on_resync, blocks).run()

    def _join_shared_store(self, replica: Replica, metrics: EngineMetrics) -> None:
        """The shared store a vLLM replica's kvyard connector loads from, as its metrics name it (a new id: the
        store was flushed or restarted, and what the router knew of the old one is dropped)."""
        store_id = metrics.shared_store
        if store_id is None:
            return
        if store_id != replica.shared_store_id:
            self.shared_stores.cleared(replica.shared_store_id, store_id)
            replica.shared_store_id = store_id
        self.shared_stores.joined(store_id, metrics.shared_ttl_s)

    async def _load(self, replica: Replica, timeout: float) -> LoadReport | None:
        """The replica's load report, after checking its health; None when only its health was checked (the report
        it had stands, and the router's own counts of what it sent keep it current)."""
        if replica.kind in ENGINE_KINDS:
            now = time.monotonic()
            if now - replica.metrics_at < ENGINE_METRICS_INTERVAL_S:
                await self._health_only(replica, timeout)
                return None
            replica.metrics_at = now
            return self._engine_load(replica, await self._engine_metrics(replica, timeout))
        if replica.kind != KVYARD:  # another server: health only, the router's own counts
            return await self._health_only(replica, timeout)
        return LoadReport.from_json(orjson.loads((await _get(replica, "/load", timeout, replica.api_headers)).body))

    async def _engine_metrics(self, replica: Replica, timeout: float) -> EngineMetrics:
        response = await _get(replica, "/metrics", timeout, replica.api_headers)
        return EngineMetrics.parse(replica.kind, response.body.decode(errors="replace"))

    def _engine_load(self, replica: Replica, metrics: EngineMetrics) -> LoadReport:
        """vLLM's or SGLang's metrics as a load report, with the speed the router measured (TtftFit)."""
        if not metrics.has_load and replica.url not in self._warned:
            self._warned.add(replica.url)
            _LOG.warning(
                "%s publishes no load metrics (a vLLM started with --disable-log-stats?): it is scored by "
                "the requests the router sent it",
                replica.url,
            )
        if replica.started_at is not None and metrics.started_at != replica.started_at and not replica.index.has_events:
            replica.index.clear()  # restarted with an empty cache (an index from events learns it from the events)
        replica.started_at = metrics.started_at
        if replica.namespace is None and metrics.block_size:  # without events: what PD pairs replicas by
            replica.namespace = engine_namespace(replica, metrics)
        self._join_shared_store(replica, metrics)
        costs: dict[str, float] = {}
        for medium, seconds, blocks in metrics.tier_loads:
            estimate = replica.tier_costs.setdefault(medium, RecentCost()).update(seconds, blocks)
            if estimate is not None:
                costs[medium] = estimate
        total = metrics.num_blocks or 0
        return LoadReport(
            num_waiting=metrics.waiting,
            num_running=metrics.running,
            kv_blocks_used=round(metrics.kv_usage * total),
            kv_blocks_total=total,
            prefill_s_per_token=replica.ttft.s_per_token,
            local_tier_s_per_block=costs.get("local", 0.0),
            shared_tier_s_per_block=costs.get("shared", 0.0),
        )

    async def _health_only(self, replica: Replica, timeout: float) -> LoadReport:
        """/health, unless the replica is healthy and answered a request since the last check (while traffic flows,
        the requests are the checks: a busy fleet's routers would otherwise ask every replica twice a second)."""
        if replica.routable and time.monotonic() - replica.answered_at < self.config.health_interval_s:
            return LoadReport()
        await _get(replica, "/health", timeout)
        return LoadReport()

    async def _kv_sync_loop(self, replica: Replica) -> None:
        await KVSync(replica, self._on_resync, self.shared_stores).run()

    def _on_resync(self, replica: Replica, reason: str) -> None:
        replica.resyncs += 1
        self.metrics.resyncs.labels(replica.url, reason).inc()
        _LOG.info("cache index of %s rebuilt (%s)", replica.url, reason)


def engine_namespace(replica: Replica, metrics: EngineMetrics) -> KeyNamespace:
    """The block namespace of a vLLM or SGLang replica: its model, engine, KV dtype and block size (16 until known)."""
    model = replica.model_cards[0] if replica.model_cards else None
    return KeyNamespace(
        model.id if model else "",
        f"{replica.kind}:{model.root if model else ''}",
        metrics.cache_dtype or "auto",
        metrics.block_size or 16,
    )


async def _get(replica: Replica, path: str, timeout: float, headers: dict[str, str] | None = None) -> Response:
    """GET `path` of the replica over its keep-alive pool; HttpError unless the answer is a success."""
    response = await replica.http.request("GET", path, timeout=timeout, headers=headers)
    if not 200 <= response.status < 300:
        raise HttpError(f"GET {path}: HTTP {response.status}")
    return response

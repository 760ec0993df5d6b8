"""The replicas behind the router: add / drain / remove at run time, active health checks, ejection and
re-admission, and the tasks that keep each replica's load report and cache index current."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from kvyard.api.auth import ADMIN_KEY_HEADER, REPLICA_ADMIN_KEY_ENV, REPLICA_API_KEY_ENV
from kvyard.api.load import LoadReport
from kvyard.router.cache_index import CacheIndex
from kvyard.router.config import RouterConfig
from kvyard.router.holders import KeyHolders
from kvyard.router.kv_sync import KVSync
from kvyard.router.metrics import RouterMetrics
from kvyard.router.replica import ModelCard, Replica, State
from kvyard.router.tier_index import SharedStores

_LOG = logging.getLogger(__name__)


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
        return cls({"Authorization": f"Bearer {api_key}"} if api_key else {},
                   {"Authorization": f"Bearer {admin_key}"} if admin_key else {},
                   {ADMIN_KEY_HEADER: admin_key} if admin_key else {})  # fmt: skip


@dataclass(slots=True)
class Registry:
    config: RouterConfig
    metrics: RouterMetrics
    session: aiohttp.ClientSession
    upstream: UpstreamAuth = field(default_factory=lambda: UpstreamAuth({}, {}))
    replicas: dict[str, Replica] = field(default_factory=dict)
    shared_stores: SharedStores = field(default_factory=SharedStores)
    holders: KeyHolders = field(default_factory=KeyHolders)  # every replica's index, inverted
    _routable: list[Replica] | None = None  # the replicas routed to, kept until a state changes
    panicking: bool = False  # too few replicas are healthy: ejected ones are routed to too
    _tasks: dict[str, list[asyncio.Task[None]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shared_stores.max_keys = self.config.shared_index_keys

    def add(self, url: str, role: str | None = None) -> Replica:
        """Route to `url`; `role` (prefill or decode) overrides the role the replica reports."""
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
        replica = Replica(url, configured_role=role, index=index, connect_timeout_s=self.config.connect_timeout_s,
                          api_headers=self.upstream.api_headers, admin_headers=self.upstream.admin_headers)  # fmt: skip
        index.owner = replica
        self.replicas[url] = replica
        self._tasks[url] = [
            asyncio.create_task(self._health_loop(replica), name=f"health {url}"),
            asyncio.create_task(self._kv_sync_loop(replica), name=f"kv-sync {url}"),
        ]
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
            _LOG.warning("%s: %d of %d replicas healthy", "panic, routing to ejected replicas too" if self.panicking
                         else "out of panic", self.healthy_count(), len(self.replicas))  # fmt: skip
        self.metrics.healthy.set(self.healthy_count())
        self.metrics.panic.set(int(self.panicking))

    async def _health_loop(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        while True:
            try:
                if not replica.model_ids:
                    replica.model_cards = await self._model_cards(replica, timeout)
                    replica.model_ids = tuple(card.id for card in replica.model_cards)
                    self._refresh_gauge()  # the models it serves decide which requests it is a candidate for
                role = replica.role
                replica.load = await self._load(replica, timeout)
                if replica.role != role:
                    self._refresh_gauge()  # lists of candidates carry roles (prefill/decode disaggregation)
                replica.first_bytes_since_load = 0
                replica.consecutive_failures = 0
                self._readmit(replica)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as error:
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

    async def _model_cards(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> tuple[ModelCard, ...]:
        url, headers = f"{replica.url}/v1/models", replica.api_headers
        async with self.session.get(url, timeout=timeout, headers=headers) as response:
            response.raise_for_status()
            body = await response.json()
        return tuple(ModelCard.from_json(card) for card in body["data"])

    async def _load(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> LoadReport:
        async with self.session.get(f"{replica.url}/load", timeout=timeout, headers=replica.api_headers) as response:
            if response.status == 404:  # another engine's server: health only, the router's own counts
                return await self._health_only(replica, timeout)
            response.raise_for_status()
            body = await response.json()
        return LoadReport.from_json(body)

    async def _health_only(self, replica: Replica, timeout: aiohttp.ClientTimeout) -> LoadReport:
        async with self.session.get(f"{replica.url}/health", timeout=timeout) as response:
            response.raise_for_status()
        return LoadReport()

    async def _kv_sync_loop(self, replica: Replica) -> None:
        await KVSync(replica, self.session, self._on_resync, self.shared_stores).run()

    def _on_resync(self, replica: Replica, reason: str) -> None:
        replica.resyncs += 1
        self.metrics.resyncs.labels(replica.url, reason).inc()
        _LOG.info("cache index of %s reloaded from its snapshot (%s)", replica.url, reason)

"""Simulated replicas on loopback ports, served from a background thread of the calling process."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import cast

from prometheus_client.registry import Collector

from kvyard.api.auth import AccessConfig, admin_key_of
from kvyard.net.http_server import HttpServerConfig
from kvyard.server.kv_tier_metrics import KVTierCollector, KVTransferCollector
from kvyard.server.options import ServerOptions
from kvyard.server.serve import ReplicaCluster, ReplicaSpec
from kvyard.sim.config import SimConfig
from kvyard.sim.engine import SimEngine
from kvyard.sim.fault_routes import fault_routes
from kvyard.sim.tier import shared_store

TEST_ADMIN_KEY = "kvyard-test-admin"  # the admin key of test clusters: KV events and fault injection


def pd_roles(num_replicas: int, num_prefill: int) -> list[str]:
    """Roles of a fleet whose first `num_prefill` replicas prefill for the rest, which decode (0: all unified)."""
    if not 0 <= num_prefill <= num_replicas:
        raise ValueError(f"prefill replicas must be between 0 and the {num_replicas} replicas, got {num_prefill}")
    if num_prefill == 0:
        return ["unified"] * num_replicas
    return ["prefill"] * num_prefill + ["decode"] * (num_replicas - num_prefill)


def sim_replica_specs(
    configs: Sequence[SimConfig], options: ServerOptions | None = None, roles: Sequence[str] = ()
) -> list[ReplicaSpec]:
    """One replica per config, with its step loop and the fault-injection routes. `options`: those all replicas are
    served with (their admin key is the one a decode replica pulls with); `roles`: one per replica, else each has
    the role of `options`. Replicas with a shared KV store (`shared_store_blocks`) share one."""
    options = options or sim_server_options()
    if roles and len(roles) != len(configs):
        raise ValueError(f"{len(roles)} roles for {len(configs)} replicas")
    admin_key = admin_key_of(options.access.admin_key)
    store = shared_store(configs)
    engines = [
        SimEngine(config, index, admin_key, (transfer_collector, tier_collector), store)
        for index, config in enumerate(configs)
    ]
    own: list[ServerOptions | None] = [dataclasses.replace(options, role=role) for role in roles]
    return [
        ReplicaSpec(engine, engine.run, partial(fault_routes, engine), replica_options)
        for engine, replica_options in zip(engines, own or [None] * len(engines))
    ]


def transfer_collector(engine: SimEngine) -> Collector:
    """The KV-transfer counters of a real replica (leases, pulls), for a simulated one."""
    return KVTransferCollector(lambda: engine.core.kv_exports, engine.pull_counters, engine.model_name)


def tier_collector(engine: SimEngine) -> Collector:
    """The KV-tier counters of a real replica (kvyard_kv_tier_*), for a simulated one."""
    return KVTierCollector(engine.tier_snapshot, engine.model_name)


def sim_server_options(
    max_queued_seqs: int = 1024, http: HttpServerConfig | None = None, **access: object
) -> ServerOptions:
    """`access`: AccessConfig settings (the admin key is TEST_ADMIN_KEY unless given)."""
    settings = {"admin_key": TEST_ADMIN_KEY, **access}
    return ServerOptions(
        max_queued_seqs=max_queued_seqs,
        owned_by="kvyard-sim",
        access=AccessConfig(**settings),  # type: ignore[arg-type]
        http=http or HttpServerConfig(),
    )


class SimCluster(ReplicaCluster):
    """`with SimCluster([config] * 3) as sim: sim.urls`; `sim.replicas` are the live `SimEngine`s. `roles`: one per
    replica (see `pd_roles`), else every replica has the role of `options`."""

    def __init__(
        self, configs: Sequence[SimConfig], options: ServerOptions | None = None, roles: Sequence[str] = ()
    ) -> None:
        options = options or sim_server_options()
        super().__init__(lambda: sim_replica_specs(configs, options, roles), options)

    def __enter__(self) -> SimCluster:
        super().__enter__()
        return self

    @property
    def replicas(self) -> list[SimEngine]:
        return cast("list[SimEngine]", self.engines)

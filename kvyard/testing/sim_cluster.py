"""Simulated replicas on loopback ports, served from a background thread of the calling process."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

from kvyard.api.auth import AccessConfig
from kvyard.net.http_server import HttpServerConfig
from kvyard.server.options import ServerOptions
from kvyard.server.serve import ReplicaCluster, ReplicaSpec
from kvyard.sim.config import SimConfig
from kvyard.sim.engine import SimEngine
from kvyard.sim.fault_routes import fault_routes


def sim_replica_specs(configs: Sequence[SimConfig]) -> list[ReplicaSpec]:
    """One replica per config, with its step loop and the fault-injection routes."""
    engines = [SimEngine(config, index) for index, config in enumerate(configs)]
    return [ReplicaSpec(engine, engine.run, partial(fault_routes, engine)) for engine in engines]


TEST_ADMIN_KEY = "kvyard-test-admin"  # the admin key of test clusters: KV events and fault injection


def sim_server_options(
    max_queued_seqs: int = 1024, http: HttpServerConfig | None = None, **access: object
) -> ServerOptions:
    """Simulated replicas ignore request fields they do not know: other routers add their engine's own.
    `access`: AccessConfig settings (the admin key is TEST_ADMIN_KEY unless given)."""
    settings = {"admin_key": TEST_ADMIN_KEY, **access}
    return ServerOptions(max_queued_seqs=max_queued_seqs, ignore_unknown_fields=True, owned_by="kvyard-sim",
                         access=AccessConfig(**settings), http=http or HttpServerConfig())  # type: ignore[arg-type]  # fmt: skip


class SimCluster(ReplicaCluster):
    """`with SimCluster([config] * 3) as sim: sim.urls`; `sim.replicas` are the live `SimEngine`s."""

    def __init__(self, configs: Sequence[SimConfig], options: ServerOptions | None = None) -> None:
        super().__init__(lambda: sim_replica_specs(configs), options or sim_server_options())

    @property
    def replicas(self) -> list[SimEngine]:
        return cast("list[SimEngine]", self.engines)

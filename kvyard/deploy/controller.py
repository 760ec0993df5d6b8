"""The fleet's controller: a detached Ray actor that owns the fleet's other actors and keeps routers current.

It starts one actor per replica and per router (each runs the normal kvyard command, `ProcessActor`), named
`replica-ROLE-I` and `router-I` in the fleet's namespace, and twice a second reconciles: it asks each actor for
its URL (an actor Ray restarted has a new one) and sets every router's replica list to the fleet's. A router
ejects a dead replica on its own (failed requests, health checks) and retries the requests that had not started
streaming; the controller only adds, drains and removes. Scaling down drains first: the replica leaves every
router's list for new requests, and is stopped once no router has a request in flight there and its own queue
is empty. A restarted controller adopts the actors its earlier life started (found by name).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from kvyard.api.auth import ADMIN_KEY_ENV, API_KEYS_ENV, REPLICA_ADMIN_KEY_ENV, REPLICA_API_KEY_ENV
from kvyard.deploy.http_admin import AdminClient, AdminError
from kvyard.deploy.process import KvyardProcess, ProcessSpec
from kvyard.deploy.spec import ROLES, FleetSpec, Placement

_LOG = logging.getLogger(__name__)
RECONCILE_INTERVAL_S = 0.5
INFO_TIMEOUT_S = 2.0
_MEMBER_NAME = re.compile(r"^(?:replica-(unified|prefill|decode)|router)-(\d+)$")


@dataclass(frozen=True, slots=True)
class FleetSecrets:
    """Keys the fleet's processes use among themselves, made by `kvyard deploy` and kept by the controller."""

    replica_api_key: str  # what routers (and the controller) send to replicas
    replica_admin_key: str  # KV events, PD transfers
    router_admin_key: str  # the routers' admin plane (their replica lists)


@ray.remote
class ProcessActor(KvyardProcess):
    """A `KvyardProcess` on whichever node Ray places it."""

    def __init__(self, spec: ProcessSpec) -> None:
        super().__init__(spec, ray.util.get_node_ip_address())
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self) -> dict[str, object]:
        return {**super().info(), "node_id": self.node_id}


@dataclass(slots=True)
class Member:
    name: str
    role: str  # a replica role, or "router"
    index: int
    handle: Any  # the ProcessActor's handle
    info: dict[str, Any] = field(default_factory=dict)  # its last answer to info()
    reachable: bool = False  # answered the last info() in time
    draining: bool = False
    error: str | None = None  # why it is gone for good (its constructor failed)
    needs: dict[str, float] = field(default_factory=dict)  # the Ray resources it asked for (unknown when adopted)

    @property
    def url(self) -> str | None:
        url = self.info.get("url")
        return str(url) if url else None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "reachable": self.reachable,
            "draining": self.draining,
            "error": self.error,
            "needs": self.needs,
            **self.info,
        }


class FleetController:
    def __init__(self, spec: FleetSpec, secrets: FleetSecrets) -> None:
        self.spec = spec
        self.secrets = secrets
        self.routers_admin = AdminClient(secrets.router_admin_key)
        self.replicas_api = AdminClient(secrets.replica_api_key)
        self._members: dict[str, Member] = {}
        self._lock = threading.RLock()
        self._adopt()
        self._stopped = threading.Event()
        threading.Thread(target=self._reconcile_forever, name="reconcile", daemon=True).start()

    # ------------------------------------------------------------------ what `kvyard deploy` calls

    def apply(self) -> dict[str, Any]:
        """Start what the spec asks for and is not running; return once all of it is ready."""
        with self._lock:
            starting = [
                self._start_router(i) for i in range(self.spec.router.replicas) if f"router-{i}" not in self._members
            ]
            for role in ROLES:
                present = len(self._replicas(role))
                starting += [
                    self._start_replica(role, i)
                    for i in self._free_indices(role, present, self.spec.roles[role].replicas)
                ]
        self._wait_ready(starting)
        self._wait_routed()
        return self.status()

    def scale(self, role: str, count: int) -> dict[str, Any]:
        """Change the number of `role` replicas; fewer: the highest-numbered ones are drained, then stopped."""
        with self._lock:
            self.spec = self.spec.with_replicas(role, count)
            current = self._replicas(role)
            leaving = sorted(current, key=lambda m: m.index)[count:]
            starting = [self._start_replica(role, i) for i in self._free_indices(role, len(current), count)]
            for member in leaving:
                member.draining = True
        self._wait_ready(starting)
        self._wait_routed()
        for member in leaving:
            self._drain_and_stop(member)
        return self.status()

    def status(self) -> dict[str, Any]:
        with self._lock:
            members = sorted(self._members.values(), key=lambda m: (m.role != "router", m.role, m.index))
        views = {member.url: self._router_view(member) for member in members if member.role == "router" and member.url}
        return {
            "name": self.spec.name,
            "model": self.spec.model,
            "namespace": self.spec.namespace,
            "desired": {role: self.spec.roles[role].replicas for role in ROLES} | {"router": self.spec.router.replicas},
            "members": [member.describe() for member in members],
            "routers": views,
        }

    def down(self, grace_s: float = 30.0) -> dict[str, Any]:
        """Stop routers (they finish what they relay), then replicas; kill every actor. Returns what was stopped."""
        self._stopped.set()
        with self._lock:
            members = list(self._members.values())
            self._members.clear()
        stopped = []
        for group in ([m for m in members if m.role == "router"], [m for m in members if m.role != "router"]):
            refs = [member.handle.stop.remote(grace_s) for member in group if member.url]  # not the never-placed
            ray.wait(refs, num_returns=len(refs), timeout=grace_s + 10)
            for member in group:
                ray.kill(member.handle, no_restart=True)
                stopped.append(member.name)
        return {"stopped": stopped}

    # ------------------------------------------------------------------ keeping routers current

    def reconcile(self) -> None:
        """Refresh every member's URL from its actor, then make every reachable router's list the fleet's."""
        with self._lock:
            members = list(self._members.values())
        self._refresh(members)
        replicas = [m for m in members if m.role != "router" and m.url]
        for router in (m for m in members if m.role == "router" and m.reachable and m.url):
            try:
                self._sync_router(router.url or "", replicas)
            except AdminError as error:
                _LOG.info("router %s not synced: %s", router.name, error)

    def _wait_routed(self, timeout_s: float = 30.0) -> None:
        """Until every router routes to every replica that is not leaving (its first health check passed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.reconcile()
            with self._lock:
                wanted = {m.url for m in self._members.values() if m.role != "router" and m.url and not m.draining}
                routers = [m for m in self._members.values() if m.role == "router" and m.reachable]
            views = [self._router_view(router) for router in routers]
            if all(view.get(url, {}).get("state") == "healthy" for view in views for url in wanted):
                return
            if time.monotonic() > deadline:
                _LOG.warning("routers do not route to every replica yet: %s", views)
                return
            time.sleep(0.2)

    def _sync_router(self, router_url: str, replicas: list[Member]) -> None:
        listed = self.routers_admin.replicas(router_url)
        wanted = {member.url: member for member in replicas}
        for url, member in wanted.items():
            assert url is not None
            if url not in listed and not member.draining:
                self.routers_admin.add(
                    router_url, url, api_key=self.secrets.replica_api_key, admin_key=self.secrets.replica_admin_key
                )
            elif url in listed and member.draining and listed[url]["state"] != "draining":
                self.routers_admin.drain(router_url, url)
        external = {replica.url: replica for replica in self.spec.external_replicas}
        for url, replica in external.items():  # servers the fleet does not run (vLLM): routed to, never stopped
            if url not in listed:  # sent none of the fleet's keys
                self.routers_admin.add(router_url, url, str(replica.events) if replica.events else None)
        for url in listed:
            if url not in wanted and url not in external:  # an actor restarted on a new port, or a member that left
                self.routers_admin.remove(router_url, url)

    def _refresh(self, members: list[Member]) -> None:
        pending = {member.handle.info.remote(): member for member in members if member.error is None}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=INFO_TIMEOUT_S)
        for member in pending.values():
            member.reachable = False
        for ref in ready:
            member = pending[ref]
            try:
                member.info = ray.get(ref)
                member.reachable = True
            except ray.exceptions.RayActorError as error:
                if _failed_to_start(error):
                    member.error = str(error)[-2000:]
            except ray.exceptions.RayError as error:
                _LOG.info("%s: %s", member.name, error)

    def _reconcile_forever(self) -> None:
        while not self._stopped.wait(RECONCILE_INTERVAL_S):
            try:
                self.reconcile()
            except Exception:  # the loop must outlive any one bad round
                _LOG.exception("reconcile failed")

    # ------------------------------------------------------------------ members

    def _drain_and_stop(self, member: Member, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._busy(member):
            time.sleep(0.2)
        with self._lock:
            self._members.pop(member.name, None)
        self.reconcile()  # removes it from every router
        if member.url is not None:  # it ran: let its server finish what it serves (one never placed: just go)
            try:
                ray.get(member.handle.stop.remote(30.0), timeout=60)
            except ray.exceptions.RayError as error:
                _LOG.info("stopping %s: %s", member.name, error)
        ray.kill(member.handle, no_restart=True)

    def _busy(self, member: Member) -> bool:
        """A router still relays a request to `member`, or it still runs or queues one."""
        url = member.url
        if url is None:
            return False
        self.reconcile()
        with self._lock:
            routers = [m.url for m in self._members.values() if m.role == "router" and m.reachable and m.url]
        try:
            for router_url in routers:
                entry = self.routers_admin.replicas(router_url or "").get(url)
                if entry is not None and (entry["state"] != "draining" or entry["in_flight"]):
                    return True
            load = self.replicas_api.load(url)
        except AdminError:
            return not member.reachable and self._alive(member)
        return bool(load.get("num_running", 0) or load.get("num_waiting", 0))

    def _alive(self, member: Member) -> bool:
        try:
            ray.get(member.handle.info.remote(), timeout=INFO_TIMEOUT_S)
        except ray.exceptions.RayError:
            return False
        return True

    def _router_view(self, router: Member) -> dict[str, Any]:
        try:
            listed = self.routers_admin.replicas(router.url or "")
        except AdminError as error:
            return {"error": str(error)}
        return {
            url: {
                "state": entry["state"],
                "in_flight": entry["in_flight"],
                "role": entry["role"],
                "kind": entry.get("kind"),
                "kv_events_endpoint": entry.get("kv_events_endpoint"),
            }
            for url, entry in listed.items()
        }

    def _replicas(self, role: str) -> list[Member]:
        return [m for m in self._members.values() if m.role == role and not m.draining]

    def _free_indices(self, role: str, present: int, wanted: int) -> list[int]:
        taken = {m.index for m in self._members.values() if m.role == role}
        free = (index for index in range(len(taken) + wanted + 1) if index not in taken)
        return [next(free) for _ in range(max(0, wanted - present))]

    def _start_replica(self, role: str, index: int) -> Member:
        spec = self.spec
        command = ["serve", *([] if spec.model == "demo" else [spec.model]), "--role", role]
        if spec.kv_tier.redis_url:
            command += ["--kv-tier", "memory,redis", "--kv-redis-url", spec.kv_tier.redis_url]
            if spec.kv_tier.redis_cluster:
                command.append("--kv-redis-cluster")
        command += spec.roles[role].options
        env = {API_KEYS_ENV: self.secrets.replica_api_key, ADMIN_KEY_ENV: self.secrets.replica_admin_key}
        process = ProcessSpec(
            f"replica-{role}-{index}",
            tuple(command),
            env,
            spec.roles[role].host,
            None,
            ports=spec.roles[role].ports,
            log_dir=f"/tmp/kvyard-deploy/{spec.namespace}",
            ready_timeout_s=spec.ready_timeout_s,
        )
        return self._start(process, role, index, spec.roles[role].placement)

    def _start_router(self, index: int) -> Member:
        spec, router = self.spec, self.spec.router
        command = ("route", "--policy", router.policy, *router.options)
        env = {
            ADMIN_KEY_ENV: self.secrets.router_admin_key,
            REPLICA_API_KEY_ENV: self.secrets.replica_api_key,
            REPLICA_ADMIN_KEY_ENV: self.secrets.replica_admin_key,
        }
        process = ProcessSpec(
            f"router-{index}",
            command,
            env,
            router.host,
            router.port + index,
            log_dir=f"/tmp/kvyard-deploy/{spec.namespace}",
            ready_timeout_s=spec.ready_timeout_s,
            ready_path="/openapi.json",
        )
        return self._start(process, "router", index, router.placement)

    def _start(self, process: ProcessSpec, role: str, index: int, placement: Placement) -> Member:
        handle = ProcessActor.options(  # type: ignore[attr-defined]
            name=process.name,
            namespace=self.spec.namespace,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=4,
            num_cpus=placement.num_cpus,
            num_gpus=placement.num_gpus,
            resources=placement.resources or None,
            scheduling_strategy="SPREAD" if placement.spread else "DEFAULT",
        ).remote(process)
        needs = {"CPU": placement.num_cpus, "GPU": placement.num_gpus, **placement.resources}
        member = Member(process.name, role, index, handle, needs={k: v for k, v in needs.items() if v})
        self._members[member.name] = member
        return member

    def _wait_ready(self, members: list[Member]) -> None:
        """Until every member answers (its constructor returned: it answers /health), or one fails to start."""
        for member in members:
            try:
                member.info = ray.get(member.handle.info.remote())
                member.reachable = True
            except ray.exceptions.RayActorError as error:
                member.error = str(error)
                raise StartFailed(member.name, str(error)) from None

    def _adopt(self) -> None:
        """The actors an earlier life of this controller started: found by their names in the namespace."""
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] != self.spec.namespace:
                continue
            match = _MEMBER_NAME.match(entry["name"])
            if match is None:
                continue
            role = match.group(1) or "router"
            handle = ray.get_actor(entry["name"], namespace=self.spec.namespace)
            self._members[entry["name"]] = Member(entry["name"], role, int(match.group(2)), handle)
        adopted = {role: len(self._replicas(role)) for role in ROLES}
        if any(adopted.values()):
            for role, count in adopted.items():
                self.spec = self.spec.with_replicas(role, count)
        routers = [member.index for member in self._members.values() if member.role == "router"]
        if routers:  # the count the earlier life ran, so a later `apply` neither drops nor adds routers
            self.spec = self.spec.with_routers(max(routers) + 1)
        if self._members:
            _LOG.warning("adopted %d actors of an earlier controller", len(self._members))


class StartFailed(RuntimeError):
    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} did not start: {reason}")
        self.name = name


def _failed_to_start(error: Exception) -> bool:
    """An actor Ray is restarting answers again later; one whose constructor raised never does."""
    return "creation task" in str(error)


ControllerActor = ray.remote(FleetController)

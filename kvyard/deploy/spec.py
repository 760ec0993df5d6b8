"""The fleet spec: one model, its replicas by role, the routers in front of them and the KV tier they share, and
replicas the fleet does not start (vLLM servers, say) that its routers route to as well; read from YAML and checked
field by field (an error names the field, as `roles.unified.replicas`)."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvyard.api.engine_kv_events import EventEndpoints

ROLES = ("unified", "prefill", "decode")
POLICIES = ("round_robin", "least_load", "session", "cache_aware")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


class SpecError(ValueError):
    """A fleet spec that cannot be deployed; the message names the field."""


@dataclass(frozen=True, slots=True)
class Placement:
    """What one process reserves on a Ray node, and how processes of one kind spread over nodes."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources, e.g. {"node_a": 1}
    spread: bool = True  # on different nodes where the cluster has room


@dataclass(frozen=True, slots=True)
class RoleSpec:
    replicas: int = 0
    placement: Placement = field(default_factory=Placement)
    host: str | None = None  # the address replicas listen on; None: their node's (routers on other nodes reach it)
    ports: tuple[int, int] | None = None  # the inclusive range their ports are taken from; None: any free port
    options: tuple[str, ...] = ()  # more `kvyard serve` options for replicas of this role


@dataclass(frozen=True, slots=True)
class RouterSpec:
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000  # router i listens on port + i
    policy: str = "cache_aware"
    placement: Placement = field(default_factory=lambda: Placement(num_cpus=0.0))  # reserve none: mostly waits
    options: tuple[str, ...] = ()  # more `kvyard route` options


@dataclass(frozen=True, slots=True)
class KVTierSpec:
    redis_url: str | None = None  # a Redis/Valkey every replica shares (adds the redis tier)
    redis_cluster: bool = False


@dataclass(frozen=True, slots=True)
class ExternalReplica:
    """A replica the fleet's routers route to but the fleet does not run: another engine's server (vLLM, SGLang),
    with where it publishes its KV events."""

    url: str
    events: EventEndpoints | None = None


RAY_PORTS = (
    "port",
    "node_manager_port",
    "object_manager_port",
    "ray_client_server_port",
    "dashboard_agent_listen_port",
    "dashboard_agent_grpc_port",
    "runtime_env_agent_port",
    "metrics_export_port",
)
RAY_LOWEST_PORT = 1024  # Ray refuses lower worker, client and agent ports (and lower ones need root)
RAY_DRIVERS = 3  # `kvyard deploy` commands connected at once (a deploy, a --status, a --scale): a worker port each


@dataclass(frozen=True, slots=True)
class RaySpec:
    """The Ray cluster `kvyard deploy` starts on this machine when none runs (`ray start --head`): its node
    address and ports, named as `ray start`'s options are. None leaves the choice to Ray; a cluster that runs
    already keeps the ports it was started with."""

    node_ip_address: str | None = None  # which of the machine's addresses Ray's node takes (one with several)
    port: int | None = None  # the GCS, where drivers and other nodes connect (Ray's default: 6379)
    node_manager_port: int | None = None
    object_manager_port: int | None = None
    ray_client_server_port: int | None = None
    dashboard_agent_listen_port: int | None = None
    dashboard_agent_grpc_port: int | None = None
    runtime_env_agent_port: int | None = None
    metrics_export_port: int | None = None
    worker_ports: tuple[int, int] | None = None  # inclusive; each Ray worker process (actor, driver) takes one

    @property
    def is_set(self) -> bool:
        return self != RaySpec()

    def single_ports(self) -> dict[str, int]:
        """The ports set, by field name (`port`, `node_manager_port`, ...)."""
        ports = {name: getattr(self, name) for name in RAY_PORTS}
        return {name: port for name, port in ports.items() if port is not None}

    def fields_set(self) -> list[str]:
        """The fields given, as `ray.port`, for messages."""
        return [f"ray.{item.name}" for item in dataclasses.fields(self) if getattr(self, item.name) is not None]


@dataclass(frozen=True, slots=True)
class FleetSpec:
    name: str
    model: str  # a model directory present on every node, or "demo" for the embedded demo model
    roles: dict[str, RoleSpec]
    router: RouterSpec = field(default_factory=RouterSpec)
    kv_tier: KVTierSpec = field(default_factory=KVTierSpec)
    ready_timeout_s: float = 600.0  # longest wait for one process to answer /health
    external_replicas: tuple[ExternalReplica, ...] = ()
    ray: RaySpec = field(default_factory=RaySpec)

    @property
    def namespace(self) -> str:
        """The Ray namespace holding this fleet's actors."""
        return f"kvyard-{self.name}"

    def with_replicas(self, role: str, count: int) -> FleetSpec:
        if role not in ROLES:
            raise SpecError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        if count < 0:
            raise SpecError(f"roles.{role}.replicas must be 0 or more, got {count}")
        roles = {**self.roles, role: dataclasses.replace(self.roles[role], replicas=count)}
        return dataclasses.replace(self, roles=roles)

    def with_routers(self, count: int) -> FleetSpec:
        if count < 1:
            raise SpecError(f"router.replicas must be 1 or more, got {count}")
        return dataclasses.replace(self, router=dataclasses.replace(self.router, replicas=count))


def load_spec(path: str | Path) -> FleetSpec:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise SpecError(f"cannot read the fleet spec {path}: {error.strerror or error}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecError(f"{path} is not valid YAML: {error}") from None
    return parse_spec(document)


def parse_spec(document: Any) -> FleetSpec:
    top = _mapping(
        document,
        "the fleet spec",
        {"name", "model", "roles", "router", "kv_tier", "ready_timeout_s", "external_replicas", "ray"},
    )
    name = _string(top.get("name", "default"), "name")
    if not _NAME.match(name):
        raise SpecError(f"name must be lower-case letters, digits and '-', at most 40, got {name!r}")
    roles_doc = _mapping(top.get("roles", {}), "roles", set(ROLES))
    roles = {role: _role(roles_doc.get(role, {}), f"roles.{role}") for role in ROLES}
    external = _external_replicas(top.get("external_replicas", []))
    if "model" not in top and any(spec.replicas for spec in roles.values()):
        raise SpecError('model is required: a model directory on every node, or "demo"')
    if not any(spec.replicas for spec in roles.values()) and not external:
        raise SpecError(
            "roles: at least one replica is needed (roles.unified.replicas, or prefill and decode, or "
            "external_replicas)"
        )
    if roles["prefill"].replicas and not roles["decode"].replicas and not roles["unified"].replicas:
        raise SpecError("roles.prefill needs replicas that decode: roles.decode.replicas or roles.unified.replicas")
    router = _router(top.get("router", {}))
    ray = _ray(top.get("ray", {}))
    _check_ray_ports_apart(ray, roles, router)
    _check_ray_worker_ports(ray, roles, router)
    return FleetSpec(
        name=name,
        model=_string(top.get("model", "demo"), "model"),
        roles=roles,
        router=router,
        kv_tier=_kv_tier(top.get("kv_tier", {})),
        ready_timeout_s=_number(top.get("ready_timeout_s", 600.0), "ready_timeout_s", minimum=1.0),
        external_replicas=external,
        ray=ray,
    )


def _external_replicas(value: Any) -> tuple[ExternalReplica, ...]:
    if not isinstance(value, list):
        raise SpecError(f"external_replicas must be a list of {{url, events}}, got {type(value).__name__}")
    replicas = []
    for position, entry in enumerate(value):
        where = f"external_replicas[{position}]"
        doc = _mapping(entry, where, {"url", "events"})
        url = _string(doc.get("url"), f"{where}.url")
        if not url.startswith(("http://", "https://")):
            raise SpecError(f"{where}.url must start with http:// or https://, got {url!r}")
        events = doc.get("events")
        try:
            endpoints = EventEndpoints.parse(_string(events, f"{where}.events")) if events is not None else None
        except ValueError as error:
            raise SpecError(f"{where}.events: {error}") from None
        replicas.append(ExternalReplica(url.rstrip("/"), endpoints))
    if len({replica.url for replica in replicas}) != len(replicas):
        raise SpecError("external_replicas: each URL once")
    return tuple(replicas)


def _role(document: Any, where: str) -> RoleSpec:
    fields = {"replicas", "options", "host", "ports", *_PLACEMENT_FIELDS}
    doc = _mapping(document, where, fields)
    return RoleSpec(
        replicas=_integer(doc.get("replicas", 0), f"{where}.replicas", minimum=0),
        placement=_placement(doc, where, Placement()),
        options=_options(doc.get("options", []), f"{where}.options", _SET_FOR_REPLICAS),
        host=_string(doc["host"], f"{where}.host") if doc.get("host") is not None else None,
        ports=_port_range(doc["ports"], f"{where}.ports") if doc.get("ports") is not None else None,
    )


def _port_range(value: Any, where: str, lowest: int = 1) -> tuple[int, int]:
    """`9000-9099` (or `[9000, 9099]`): the first and last port, inclusive."""
    parts: Any = value.split("-") if isinstance(value, str) else value
    if not isinstance(parts, list) or len(parts) != 2:
        raise SpecError(f"{where} must be a range like 9000-9099, got {value!r}")
    try:
        first, last = (int(part) for part in parts)
    except (TypeError, ValueError):
        raise SpecError(f"{where} must be a range like 9000-9099, got {value!r}") from None
    if not lowest <= first <= last <= 65535:
        raise SpecError(f"{where} must run from a port to a later one within {lowest}-65535, got {value!r}")
    return first, last


def _ray(document: Any) -> RaySpec:
    doc = _mapping(document, "ray", {"node_ip_address", "worker_ports", *RAY_PORTS})

    def port(name: str) -> int | None:
        value = doc.get(name)
        return None if value is None else _integer(value, f"ray.{name}", minimum=RAY_LOWEST_PORT, maximum=65535)

    workers, address = doc.get("worker_ports"), doc.get("node_ip_address")
    return RaySpec(
        node_ip_address=_ip_address(address, "ray.node_ip_address") if address is not None else None,
        port=port("port"),
        node_manager_port=port("node_manager_port"),
        object_manager_port=port("object_manager_port"),
        ray_client_server_port=port("ray_client_server_port"),
        dashboard_agent_listen_port=port("dashboard_agent_listen_port"),
        dashboard_agent_grpc_port=port("dashboard_agent_grpc_port"),
        runtime_env_agent_port=port("runtime_env_agent_port"),
        metrics_export_port=port("metrics_export_port"),
        worker_ports=_port_range(workers, "ray.worker_ports", RAY_LOWEST_PORT) if workers is not None else None,
    )


def _ip_address(value: Any, where: str) -> str:
    try:
        address = ipaddress.ip_address(_string(value, where))
    except ValueError:
        raise SpecError(f"{where} must be an IP address of this machine, as 10.0.0.5, got {value!r}") from None
    if address.is_loopback:
        keep = "set roles.ROLE.host (and router.host) to 127.0.0.1 to keep the fleet on loopback"
        raise SpecError(
            f"{where}: Ray replaces a loopback address ({value}) with this machine's own; leave it out, and {keep}"
        )
    return str(address)


def _check_ray_ports_apart(ray: RaySpec, roles: Mapping[str, RoleSpec], router: RouterSpec) -> None:
    """Each of Ray's ports is one process's, and the fleet's own processes take theirs from the same machine."""
    ranges = [(f"ray.{name}", (port, port)) for name, port in ray.single_ports().items()]
    if ray.worker_ports is not None:
        ranges.append(("ray.worker_ports", ray.worker_ports))
    if not ranges:
        return
    fleet = [(f"roles.{role}.ports", spec.ports) for role, spec in roles.items() if spec.replicas and spec.ports]
    fleet.append(("router.port", (router.port, router.port + router.replicas - 1)))
    for position, (name, span) in enumerate(ranges):
        for other, other_span in [*ranges[position + 1 :], *fleet]:
            if span[0] <= other_span[1] and other_span[0] <= span[1]:
                raise SpecError(
                    f"{name} ({_show(span)}) and {other} ({_show(other_span)}) overlap: each port can "
                    "serve one process only"
                )


def _check_ray_worker_ports(ray: RaySpec, roles: Mapping[str, RoleSpec], router: RouterSpec) -> None:
    """Ray gives each worker process a port of the range; once they are all taken, a new actor waits for one, with
    no error, for as long as the deploy waits."""
    if ray.worker_ports is None:
        return
    replicas = sum(spec.replicas for spec in roles.values())
    needed = replicas + router.replicas + 1 + RAY_DRIVERS
    have = ray.worker_ports[1] - ray.worker_ports[0] + 1
    if have < needed:
        raise SpecError(
            f"ray.worker_ports {_show(ray.worker_ports)} holds {have} port(s); Ray gives one to each worker process: "
            f"{replicas} replica(s), {router.replicas} router(s), the controller and up to {RAY_DRIVERS} kvyard "
            f"deploy commands connected at once need {needed} (more to scale up)"
        )


def _show(span: tuple[int, int]) -> str:
    return str(span[0]) if span[0] == span[1] else f"{span[0]}-{span[1]}"


def _router(document: Any) -> RouterSpec:
    fields = {"replicas", "host", "port", "policy", "options", *_PLACEMENT_FIELDS}
    doc = _mapping(document, "router", fields)
    defaults = RouterSpec()
    policy = _string(doc.get("policy", defaults.policy), "router.policy")
    if policy not in POLICIES:
        raise SpecError(f"router.policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return RouterSpec(
        replicas=_integer(doc.get("replicas", defaults.replicas), "router.replicas", minimum=1),
        host=_string(doc.get("host", defaults.host), "router.host"),
        port=_integer(doc.get("port", defaults.port), "router.port", minimum=1, maximum=65535),
        policy=policy,
        placement=_placement(doc, "router", defaults.placement),
        options=_options(doc.get("options", []), "router.options", _SET_FOR_ROUTERS),
    )


def _kv_tier(document: Any) -> KVTierSpec:
    doc = _mapping(document, "kv_tier", {"redis_url", "redis_cluster"})
    url = doc.get("redis_url")
    if url is not None and not (isinstance(url, str) and url.startswith(("redis://", "rediss://", "unix://"))):
        raise SpecError(f"kv_tier.redis_url must be a redis:// URL, got {url!r}")
    return KVTierSpec(url, _boolean(doc.get("redis_cluster", False), "kv_tier.redis_cluster"))


_PLACEMENT_FIELDS = ("num_cpus", "num_gpus", "resources", "spread")


def _placement(doc: Mapping[str, Any], where: str, defaults: Placement) -> Placement:
    resources = _mapping(doc.get("resources", {}), f"{where}.resources", None)
    return Placement(
        num_cpus=_number(doc.get("num_cpus", defaults.num_cpus), f"{where}.num_cpus", minimum=0.0),
        num_gpus=_number(doc.get("num_gpus", defaults.num_gpus), f"{where}.num_gpus", minimum=0.0),
        resources={
            str(key): _number(value, f"{where}.resources.{key}", minimum=0.0) for key, value in resources.items()
        },
        spread=_boolean(doc.get("spread", defaults.spread), f"{where}.spread"),
    )


def _mapping(value: Any, where: str, allowed: set[str] | None) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where} must be a mapping, got {type(value).__name__}")
    if allowed is not None:
        for key in value:
            if key not in allowed:
                prefix = "" if where == "the fleet spec" else f"{where}."
                raise SpecError(f"{prefix}{key}: unknown field; fields here: {', '.join(sorted(allowed))}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where} must be true or false, got {value!r}")
    return value


def _integer(value: Any, where: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{where} must be an integer of at least {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{where} must be at most {maximum}, got {value}")
    return value


def _number(value: Any, where: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise SpecError(f"{where} must be a number of at least {minimum:g}, got {value!r}")
    return float(value)


_SET_FOR_REPLICAS = ("--host", "--port", "--role", "--api-key", "--api-keys-file", "--admin-key")
_SET_FOR_ROUTERS = (
    "--host",
    "--port",
    "--policy",
    "--admin-key",
    "--replica",
    "--prefill",
    "--decode",
    "--replica-api-key",
    "--replica-admin-key",
)


def _options(value: Any, where: str, set_by_deploy: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise SpecError(f'{where} must be a list of command-line words, e.g. ["--max-num-seqs", "64"]')
    if not isinstance(value, list):
        raise SpecError(f"{where} must be a list, got {type(value).__name__}")
    words = []
    for position, word in enumerate(value):
        if isinstance(word, bool) or not isinstance(word, str | int | float):
            raise SpecError(f"{where}[{position}] must be a string or a number, got {word!r}")
        words.append(str(word))
    for word in words:
        if word.split("=", 1)[0] in set_by_deploy:
            raise SpecError(f"{where}: {word.split('=', 1)[0]} is set by kvyard deploy")
    return tuple(words)

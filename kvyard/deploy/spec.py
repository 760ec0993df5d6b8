"""The fleet spec: one model, its replicas by role, the routers in front of them and the KV tier they share, and
replicas the fleet does not start (vLLM servers, say) that its routers route to as well; read from YAML and checked
field by field (an error names the field, as `roles.unified.replicas`)."""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True, slots=True)
class FleetSpec:
    name: str
    model: str  # a model directory present on every node, or "demo" for the embedded demo model
    roles: dict[str, RoleSpec]
    router: RouterSpec = field(default_factory=RouterSpec)
    kv_tier: KVTierSpec = field(default_factory=KVTierSpec)
    ready_timeout_s: float = 600.0  # longest wait for one process to answer /health
    external_replicas: tuple[ExternalReplica, ...] = ()

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
    top = _mapping(document, "the fleet spec", {"name", "model", "roles", "router", "kv_tier", "ready_timeout_s",
                                                "external_replicas"})  # fmt: skip
    name = _string(top.get("name", "default"), "name")
    if not _NAME.match(name):
        raise SpecError(f"name must be lower-case letters, digits and '-', at most 40, got {name!r}")
    roles_doc = _mapping(top.get("roles", {}), "roles", set(ROLES))
    roles = {role: _role(roles_doc.get(role, {}), f"roles.{role}") for role in ROLES}
    external = _external_replicas(top.get("external_replicas", []))
    if "model" not in top and any(spec.replicas for spec in roles.values()):
        raise SpecError('model is required: a model directory on every node, or "demo"')
    if not any(spec.replicas for spec in roles.values()) and not external:
        raise SpecError("roles: at least one replica is needed (roles.unified.replicas, or prefill and decode, or "
                        "external_replicas)")  # fmt: skip
    if roles["prefill"].replicas and not roles["decode"].replicas and not roles["unified"].replicas:
        raise SpecError("roles.prefill needs replicas that decode: roles.decode.replicas or roles.unified.replicas")
    return FleetSpec(
        name=name,
        model=_string(top.get("model", "demo"), "model"),
        roles=roles,
        router=_router(top.get("router", {})),
        kv_tier=_kv_tier(top.get("kv_tier", {})),
        ready_timeout_s=_number(top.get("ready_timeout_s", 600.0), "ready_timeout_s", minimum=1.0),
        external_replicas=external,
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


def _port_range(value: Any, where: str) -> tuple[int, int]:
    """`9000-9099` (or `[9000, 9099]`): the first and last port, inclusive."""
    parts: Any = value.split("-") if isinstance(value, str) else value
    if not isinstance(parts, list) or len(parts) != 2:
        raise SpecError(f"{where} must be a range like 9000-9099, got {value!r}")
    try:
        first, last = (int(part) for part in parts)
    except (TypeError, ValueError):
        raise SpecError(f"{where} must be a range like 9000-9099, got {value!r}") from None
    if not 1 <= first <= last <= 65535:
        raise SpecError(f"{where} must run from a port to a later one within 1-65535, got {value!r}")
    return first, last


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
_SET_FOR_ROUTERS = ("--host", "--port", "--policy", "--admin-key", "--replica", "--prefill", "--decode",
                    "--replica-api-key", "--replica-admin-key")  # fmt: skip


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

"""What vLLM's `kv_connector_extra_config` may hold for kvyard's connector, checked when vLLM starts.

Types are strict on the keys kvyard knows (a string where a number belongs stops vLLM at start, naming the key);
keys it does not know are returned so the connector can warn about them, as vLLM does with unknown fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvyard.kvcache.config import KVTierConfig

PREFIX = "kv_connector_extra_config"

# key -> (KVTierConfig field, the JSON types it takes)
_TIER_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "memory_gb": ("memory_gb", (int, float)),
    "disk_dir": ("disk_dir", (str,)),
    "disk_gb": ("disk_gb", (int, float)),
    "redis_url": ("redis_url", (str,)),
    "redis_ttl_s": ("redis_ttl_s", (int,)),
    "redis_timeout_s": ("redis_timeout_s", (int, float)),
    "load_deadline_s": ("load_deadline_s", (int, float)),
}


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    tier: KVTierConfig
    ignored: tuple[str, ...]  # keys kvyard does not know
    # How long a disaggregated request (`do_remote_prefill`) waits for the prefill replica's blocks to reach the tier
    # before its decode replica computes what has not come.
    remote_prefill_wait_s: float = 60.0
    # Where the tier's writer thread runs (None: on the cores of the worker that starts it). vLLM's CPU backend binds
    # its compute threads to cores; a writer there takes its checksums and writes from the forward pass.
    writer_cpus: frozenset[int] | None = None


def connector_config(extra: Mapping[str, object]) -> ConnectorConfig:
    """The tier the connector builds from `extra`; ValueError naming the key for a value of the wrong type."""
    options: dict[str, object] = {}
    for key, (field, types) in _TIER_KEYS.items():
        if key not in extra:
            continue
        value = extra[key]
        if isinstance(value, bool) or not isinstance(value, types):
            expected = "a number" if float in types else ("an integer" if int in types else "a string")
            raise ValueError(f"{PREFIX}.{key} must be {expected}, got {value!r}")
        options[field] = value
    wait = extra.get("remote_prefill_wait_s", 60.0)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not wait > 0:
        raise ValueError(f"{PREFIX}.remote_prefill_wait_s must be a positive number, got {wait!r}")
    tiers = _tiers(extra.get("tiers"))
    try:
        tier = KVTierConfig(tiers=tiers, **options)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"{PREFIX}: {error}") from None
    known = {*_TIER_KEYS, "tiers", "remote_prefill_wait_s", "writer_cpus"}
    ignored = tuple(sorted(key for key in extra if key not in known))
    return ConnectorConfig(tier, ignored, float(wait), _cpus(extra.get("writer_cpus")))


def _tiers(value: object) -> tuple[str, ...] | None:
    """`"memory,disk,redis"` or `["memory", "disk"]`; None (absent) is the tier's default."""
    if value is None:
        return None
    names: list[object] = [*value.split(",")] if isinstance(value, str) else [*value] if isinstance(value, list) else []
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise ValueError(f'{PREFIX}.tiers must be a comma-separated string such as "memory,disk,redis", got {value!r}')
    return tuple(str(name).strip().lower() for name in names)


def _cpus(value: object) -> frozenset[int] | None:
    """`"0,2-3"` (Linux's cpu-list format); None (absent) leaves the writer where it starts."""
    if value is None:
        return None
    cpus: set[int] = set()
    try:
        if not isinstance(value, str) or not value.strip():
            raise ValueError
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f'{PREFIX}.writer_cpus must be a CPU list such as "0,2-3", got {value!r}') from None
    return frozenset(cpus)

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
    tiers = _tiers(extra.get("tiers"))
    try:
        tier = KVTierConfig(tiers=tiers, **options)  # type: ignore[arg-type]
    except ValueError as error:
        raise ValueError(f"{PREFIX}: {error}") from None
    ignored = tuple(sorted(key for key in extra if key not in _TIER_KEYS and key != "tiers"))
    return ConnectorConfig(tier, ignored)


def _tiers(value: object) -> tuple[str, ...] | None:
    """`"memory,disk,redis"` or `["memory", "disk"]`; None (absent) is the tier's default."""
    if value is None:
        return None
    names: list[object] = [*value.split(",")] if isinstance(value, str) else [*value] if isinstance(value, list) else []
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise ValueError(f'{PREFIX}.tiers must be a comma-separated string such as "memory,disk,redis", got {value!r}')
    return tuple(str(name).strip().lower() for name in names)

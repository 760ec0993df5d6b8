"""Configuration of the KV tier and the factory that builds a tiered store from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvyard.kvcache.disk_tier import DiskTier
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.tier import Tier
from kvyard.kvcache.tiered_store import TieredStore
from kvyard.paths import cache_root

TIER_NAMES = ("memory", "disk", "redis")
GIB = 1 << 30


def default_disk_dir() -> Path:
    return cache_root() / "kv-blocks"


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """Which tiers to use, top (fastest) first, and their limits."""

    tiers: tuple[str, ...] = ("memory", "disk")
    memory_bytes: int = 2 * GIB
    disk_dir: str | None = None  # default: default_disk_dir()
    disk_bytes: int = 32 * GIB
    disk_fsync: bool = False  # a torn file after power loss is caught by the checksum anyway
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_ttl_s: int = 24 * 3600
    redis_timeout_s: float = 1.0
    queue_bytes: int = 512 << 20
    load_deadline_s: float = 2.0

    def __post_init__(self) -> None:
        unknown = [name for name in self.tiers if name not in TIER_NAMES]
        if unknown or not self.tiers:
            raise ValueError(f"kv tiers must be a non-empty subset of {TIER_NAMES}, got {list(self.tiers)}")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"kv tiers listed twice: {list(self.tiers)}")
        if "redis" in self.tiers and not self.redis_url:
            raise ValueError("the redis kv tier needs a URL (--kv-redis-url redis://host:port)")
        if self.load_deadline_s <= 0:
            raise ValueError(f"kv load deadline must be positive, got {self.load_deadline_s}")

    @staticmethod
    def from_spec(spec: str | None, redis_url: str | None = None, **options: object) -> KVTierConfig | None:
        """`"memory,disk,redis"`; None or "" means the default (memory, disk, plus redis when a URL
        is given); "none" turns the tier off."""
        if spec is not None and spec.strip().lower() == "none":
            return None
        if spec:
            tiers = tuple(name.strip().lower() for name in spec.split(",") if name.strip())
        else:
            tiers = ("memory", "disk", "redis") if redis_url else ("memory", "disk")
        return KVTierConfig(tiers=tiers, redis_url=redis_url, **options)  # type: ignore[arg-type]

    def build(self) -> TieredStore:
        order = {name: index for index, name in enumerate(TIER_NAMES)}
        return TieredStore([self._tier(name) for name in sorted(self.tiers, key=order.__getitem__)], self.queue_bytes)

    def _tier(self, name: str) -> Tier:
        if name == "memory":
            return MemoryTier(self.memory_bytes)
        if name == "disk":
            return DiskTier(self.disk_dir or default_disk_dir(), self.disk_bytes, self.disk_fsync)
        from kvyard.kvcache.redis_tier import RedisTier

        assert self.redis_url is not None
        return RedisTier(self.redis_url, self.redis_ttl_s, self.redis_cluster, timeout_s=self.redis_timeout_s)

"""Configuration of the KV tier and the factory that builds a tiered store from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvyard.kvcache.disk_tier import DiskTier
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.tier import Tier
from kvyard.kvcache.tiered_store import TieredStore
from kvyard.paths import cache_root
from kvyard.settings import setting

TIER_NAMES = ("memory", "disk", "redis")
GIB = 1 << 30


def default_disk_dir() -> Path:
    return cache_root() / "kv-blocks"


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """KV tier: a persistent prefix cache below the device cache (host memory, local disk, Redis/Valkey)."""

    tiers: tuple[str, ...] | None = setting(
        None,
        flag="--kv-tier",
        metavar="TIERS",
        help="comma-separated tiers from memory,disk,redis; none turns the tier off",
        default_text="memory, plus disk when --kv-disk-dir is given and redis when --kv-redis-url is",
    )
    memory_gb: float = setting(2.0, flag="--kv-memory-gb", help="budget of the host-memory tier")
    disk_dir: str | None = setting(
        None,
        flag="--kv-disk-dir",
        help="directory of the disk tier (none: kv-blocks under $KVYARD_CACHE_DIR, by default ~/.cache/kvyard)",
    )
    disk_gb: float = setting(32.0, flag="--kv-disk-gb", help="budget of the disk tier")
    disk_fsync: bool = setting(
        False,
        flag="--kv-disk-fsync",
        help="fsync each block file (a file torn by a power loss is caught by its checksum anyway)",
    )
    redis_url: str | None = setting(
        None,
        flag="--kv-redis-url",
        help="Redis/Valkey URL, e.g. redis://127.0.0.1:6379/0; with a password and "
        "TLS: rediss://:PASSWORD@HOST:PORT/0?ssl_ca_certs=CA.pem",
        secret=True,
    )
    redis_cluster: bool = setting(False, flag="--kv-redis-cluster", help="the Redis URL points at a Redis Cluster")
    redis_ttl_s: int = setting(24 * 3600, flag="--kv-redis-ttl-s", help="expiry of blocks in Redis, in seconds")
    redis_timeout_s: float = setting(1.0, flag="--kv-redis-timeout-s", help="longest wait for one Redis operation")
    load_deadline_s: float = setting(
        2.0,
        flag="--kv-load-deadline-s",
        help="longest wait for blocks at admission; what has not arrived by then is recomputed",
    )
    load_min_speedup: float = setting(
        2.0,
        flag="--kv-load-min-speedup",
        help="a load keeps going past its deadline "
        "while it brings blocks at least this many times faster than the replica "
        "computes them (its measured prefill rate); 0: stop at the deadline",
    )
    queue_bytes: int = 512 << 20  # blocks waiting to be written beyond this are dropped (counted)

    def __post_init__(self) -> None:
        if self.tiers is None:  # nothing is written to disk or sent anywhere unless asked
            tiers = ("memory",) + (("disk",) if self.disk_dir else ()) + (("redis",) if self.redis_url else ())
            object.__setattr__(self, "tiers", tiers)
        assert self.tiers is not None
        unknown = [name for name in self.tiers if name not in TIER_NAMES]
        if unknown or not self.tiers:
            raise ValueError(f"kv tiers must be a non-empty subset of {TIER_NAMES}, got {list(self.tiers)}")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"kv tiers listed twice: {list(self.tiers)}")
        if "redis" in self.tiers and not self.redis_url:
            raise ValueError("the redis kv tier needs a URL (--kv-redis-url redis://host:port)")
        if self.load_deadline_s <= 0:
            raise ValueError(f"kv load deadline must be positive, got {self.load_deadline_s}")
        if not self.load_min_speedup >= 0:
            raise ValueError(f"kv load min speedup must be >= 0 (0: off), got {self.load_min_speedup}")

    @property
    def active_tiers(self) -> tuple[str, ...]:
        assert self.tiers is not None  # filled in by __post_init__
        return self.tiers

    @staticmethod
    def from_spec(spec: str | None, redis_url: str | None = None, **options: object) -> KVTierConfig | None:
        """`"memory,disk,redis"`; None or "" means the default (memory, plus disk when a directory is given and
        redis when a URL is); "none" turns the tier off."""
        tiers = tuple(name.strip().lower() for name in (spec or "").split(",") if name.strip()) or None
        if tiers == ("none",):
            return None
        return KVTierConfig(tiers=tiers, redis_url=redis_url, **options)  # type: ignore[arg-type]

    def describe(self) -> str:
        """Where blocks go, for a server's log (the Redis URL without its password)."""
        parts = {
            "memory": f"memory ({self.memory_gb:g} GB)",
            "disk": f"disk ({self.disk_dir or default_disk_dir()}, {self.disk_gb:g} GB)",
            "redis": f"redis ({_without_password(self.redis_url or '')}, expiring after {self.redis_ttl_s} s)",
        }
        return " -> ".join(parts[name] for name in TIER_NAMES if name in self.active_tiers)

    def build(self, writer_cpus: frozenset[int] | None = None) -> TieredStore:
        order = {name: index for index, name in enumerate(TIER_NAMES)}
        tiers = sorted(self.active_tiers, key=order.__getitem__)
        return TieredStore([self._tier(name) for name in tiers], self.queue_bytes, writer_cpus)

    def _tier(self, name: str) -> Tier:
        if name == "memory":
            return MemoryTier(int(self.memory_gb * GIB))
        if name == "disk":
            return DiskTier(self.disk_dir or default_disk_dir(), int(self.disk_gb * GIB), self.disk_fsync)
        from kvyard.kvcache.redis_tier import RedisTier

        assert self.redis_url is not None
        return RedisTier(self.redis_url, self.redis_ttl_s, self.redis_cluster, timeout_s=self.redis_timeout_s)


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """KV transfer: leases on a prefill replica, limits of a pull on a decode replica."""

    kv_lease_s: float = setting(
        30.0, help="how long a prefilled request's blocks stay pinned for a decode replica that has not released them"
    )
    kv_transfer_timeout_s: float = setting(
        120.0,
        help="longest a decode replica waits for a transfer, remote "
        "prefill included; what has not arrived is computed here",
    )
    kv_transfer_idle_s: float = setting(
        5.0, help="a prefill replica silent this long during a transfer (it sends heartbeats every second) is given up"
    )

    def __post_init__(self) -> None:
        for name in ("kv_lease_s", "kv_transfer_timeout_s", "kv_transfer_idle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _without_password(url: str) -> str:
    scheme, separator, rest = url.partition("://")
    _credentials, at, host = rest.rpartition("@")
    return f"{scheme}{separator}{'***@' if at else ''}{host}" if separator else url

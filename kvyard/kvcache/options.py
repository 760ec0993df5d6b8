"""Command-line options of the KV tier, shared by every command that runs an engine."""

from __future__ import annotations

import argparse

from kvyard.kvcache.config import GIB, KVTierConfig, default_disk_dir


def add_kv_tier_arguments(parser: argparse.ArgumentParser, default_on: bool = True) -> None:
    group = parser.add_argument_group("KV tier (persistent prefix cache below the device cache)")
    default = "memory,disk (+redis when --kv-redis-url is given)" if default_on else "none"
    group.add_argument("--kv-tier", default=None if default_on else "none",
                       help=f"comma-separated tiers from memory,disk,redis, or none (default: {default})")  # fmt: skip
    group.add_argument("--kv-disk-dir", default=None,
                       help=f"directory of the disk tier (default: {default_disk_dir()})")  # fmt: skip
    group.add_argument("--kv-redis-url", default=None, help="Redis/Valkey URL, e.g. redis://127.0.0.1:6379/0")
    group.add_argument("--kv-redis-cluster", action="store_true", help="the Redis URL points at a Redis Cluster")
    group.add_argument("--kv-redis-ttl-s", type=int, default=24 * 3600, help="expiry of blocks in Redis")
    group.add_argument("--kv-memory-gb", type=float, default=2.0, help="host-memory tier budget")
    group.add_argument("--kv-disk-gb", type=float, default=32.0, help="disk tier budget")
    group.add_argument("--kv-load-deadline-ms", type=float, default=2000.0,
                       help="longest wait for blocks at admission; what has not arrived is recomputed")  # fmt: skip


def kv_tier_config(args: argparse.Namespace) -> KVTierConfig | None:
    return KVTierConfig.from_spec(
        args.kv_tier,
        redis_url=args.kv_redis_url,
        disk_dir=args.kv_disk_dir,
        redis_cluster=args.kv_redis_cluster,
        redis_ttl_s=args.kv_redis_ttl_s,
        memory_bytes=int(args.kv_memory_gb * GIB),
        disk_bytes=int(args.kv_disk_gb * GIB),
        load_deadline_s=args.kv_load_deadline_ms / 1000,
    )

"""Tier visibility (docs/contracts.md §7): the events a tiered store publishes replay to exactly what its tiers
hold; a shared store's id changes when it is flushed or restarted; a stalled store says it is unavailable."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_utils import RedisProcess, start_redis

from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.kvcache.codec import BlockFormat, encode_block
from kvyard.kvcache.disk_tier import DiskTier
from kvyard.kvcache.events import KVEvent, KVEventLog
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.redis_tier import RedisTier
from kvyard.kvcache.tiered_store import BlockWrite, TieredStore
from kvyard.sim.tier import SharedStoreView

NAMESPACE = KeyNamespace("tiny", "digest0", "uint8", 4)
ROOT = NAMESPACE.root_key()
FMT = BlockFormat("uint8", (1, 16))
FOREVER = float("inf")


def chain(count: int, first_token: int = 0) -> list[bytes]:
    return chain_block_keys(ROOT, list(range(first_token, first_token + count * 4)), 4)


def blob(key: bytes) -> bytes:
    return encode_block(ROOT, key, FMT, key[:16])


def write(store: TieredStore, keys: list[bytes]) -> None:
    store.submit([BlockWrite(ROOT, key, FMT, blob=blob(key)) for key in keys])
    assert store.flush(10)


def replay(events: list[KVEvent], medium: str) -> set[bytes]:
    held: set[bytes] = set()
    for event in events:
        if event.medium != medium:
            continue
        if event.kind == "stored":
            held.update(event.block_keys)
        elif event.kind == "removed":
            held.difference_update(event.block_keys)
    return held


def all_events(log: KVEventLog) -> list[KVEvent]:
    events, complete = log.events_since(0)
    assert complete
    return events


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = start_redis(tmp_path, extra=("--enable-debug-command", "yes"))
    yield server
    server.kill()


def test_local_events_replay_to_what_memory_and_disk_hold_through_writes_evictions_and_promotions(
    tmp_path: Path,
) -> None:
    blob_bytes = len(blob(chain(1)[0]))
    memory, disk = MemoryTier(6 * blob_bytes), DiskTier(tmp_path / "kv", 20 * blob_bytes)
    store = TieredStore([memory, disk])
    store.events = KVEventLog()
    rng = random.Random(7)
    conversations = [chain(12, first_token=1000 * c) for c in range(6)]
    for _ in range(60):
        keys = rng.choice(conversations)[: rng.randint(1, 12)]
        if rng.random() < 0.5:
            write(store, keys)
        else:  # loads promote disk hits into memory, which evicts there
            store.load_prefix(ROOT, keys, FMT, FOREVER)
            assert store.flush(10)
        held = set(memory.keys()) | set(disk.keys())
        assert replay(all_events(store.events), "local") == held
        assert sorted(store.local_keys()) == sorted(held)
    assert not any(event.medium != "local" for event in all_events(store.events))


def test_a_block_still_on_disk_is_not_removed_when_memory_evicts_it(tmp_path: Path) -> None:
    blob_bytes = len(blob(chain(1)[0]))
    store = TieredStore([MemoryTier(2 * blob_bytes), DiskTier(tmp_path / "kv", 100 * blob_bytes)])
    store.events = KVEventLog()
    first, second = chain(2), chain(2, first_token=500)
    write(store, first)
    write(store, second)  # evicts `first` from memory; the disk keeps it
    events = all_events(store.events)
    assert [(e.kind, set(e.block_keys)) for e in events] == [("stored", set(first)), ("stored", set(second))]


def test_shared_events_of_two_replicas_replay_to_what_the_shared_store_holds() -> None:
    blob_bytes = len(blob(chain(1)[0]))
    shared = MemoryTier(8 * blob_bytes)
    shared.store_id = "store-1"
    replica_a, replica_b = TieredStore([SharedStoreView(shared)]), TieredStore([SharedStoreView(shared)])
    replica_a.events, replica_b.events = KVEventLog(), KVEventLog()
    write(replica_a, chain(5))
    write(replica_b, chain(5, first_token=800))  # evicts two of replica a's blocks: replica b says so
    events = sorted(all_events(replica_a.events) + all_events(replica_b.events), key=lambda e: e.timestamp)
    assert replay(events, "shared") == set(shared.keys()) and len(shared) == 8
    assert any(e.kind == "removed" for e in all_events(replica_b.events))
    assert replica_a.shared_store() == ("store-1", None)


def test_a_load_reports_how_many_blocks_came_from_the_replicas_own_tiers(redis_server: RedisProcess) -> None:
    memory, remote = MemoryTier(1 << 20), RedisTier(redis_server.url)
    keys = chain(4)
    memory.put_many([(key, blob(key)) for key in keys[:2]])
    remote.put_many([(key, blob(key)) for key in keys[2:]])
    loaded = TieredStore([memory, remote]).load_prefix(ROOT, keys, FMT, FOREVER)
    assert [block.key for block in loaded] == keys and loaded.num_local == 2


def test_a_flushed_or_restarted_redis_gets_a_new_store_id_and_the_replica_says_cleared(
    tmp_path: Path, redis_server: RedisProcess
) -> None:
    tier = RedisTier(redis_server.url, ttl_s=60)
    store = TieredStore([tier])
    store.events = KVEventLog()
    first_id = tier.store_id
    assert first_id is not None and store.shared_store() == (first_id, 60)
    assert RedisTier(redis_server.url).store_id == first_id  # a second replica finds the same store
    write(store, chain(3))
    assert replay(all_events(store.events), "shared") == set(chain(3))

    redis_server.client().flushall()
    assert store.load_prefix(ROOT, chain(3), FMT, FOREVER) == []
    flushed_id = tier.store_id
    assert flushed_id not in (None, first_id)
    cleared = [e for e in all_events(store.events) if e.kind == "cleared"]
    assert [(e.medium, e.store) for e in cleared] == [("shared", flushed_id)]

    port = redis_server.port
    redis_server.kill()
    restarted = start_redis(tmp_path, port=port)
    try:
        deadline = time.monotonic() + 10
        while tier.store_id == flushed_id and time.monotonic() < deadline:
            time.sleep(0.2)  # the tier backs off after the failed round trip, then reads the new epoch
            store.load_prefix(ROOT, chain(1), FMT, FOREVER)
        assert tier.store_id not in (None, first_id, flushed_id)
        assert [e.store for e in all_events(store.events) if e.kind == "cleared"] == [flushed_id, tier.store_id]
    finally:
        restarted.kill()


def test_a_stalled_redis_makes_the_store_unavailable_and_its_load_cost_rise(redis_server: RedisProcess) -> None:
    tier = RedisTier(redis_server.url, timeout_s=0.3)
    store = TieredStore([tier])
    write(store, chain(4))
    store.load_prefix(ROOT, chain(4), FMT, FOREVER)
    seconds_before, blocks_before = store.load_totals()["shared"]
    assert blocks_before == 4 and store.shared_available()
    staller = redis_server.client()
    stall = threading.Thread(target=lambda: staller.execute_command("DEBUG", "SLEEP", "2"))
    stall.start()
    try:
        time.sleep(0.2)
        assert store.load_prefix(ROOT, chain(4), FMT, FOREVER) == []
        assert not store.shared_available()
        seconds_after, blocks_after = store.load_totals()["shared"]
        assert blocks_after == blocks_before and seconds_after - seconds_before >= 0.25
    finally:
        stall.join()

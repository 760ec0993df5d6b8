"""Unit tests of the KV tier: block codec, KV copy in and out of the paged cache, each tier, the tiered store."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis_utils import RedisProcess, start_redis, start_redis_cluster

from kvyard.engine.kv_links.device_blocks import block_shape, read_blocks, write_blocks
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.kvcache.codec import (
    HEADER_BYTES,
    BlockCorruptError,
    BlockFormat,
    BlockMismatchError,
    decode_block,
    encode_block,
    frame_block,
)
from kvyard.kvcache.config import KVTierConfig
from kvyard.kvcache.disk_tier import DiskTier
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.redis_tier import RedisTier
from kvyard.kvcache.tier import LoadDeadline
from kvyard.kvcache.tiered_store import BlockWrite, TieredStore

NAMESPACE = KeyNamespace("tiny", "digest0", "float32", 4)
ROOT = NAMESPACE.root_key()
FMT = BlockFormat("float32", (2, 2, 4, 2, 8))
FOREVER = float("inf")


def keys(count: int, root: bytes = ROOT) -> list[bytes]:
    return chain_block_keys(root, list(range(count * 4)), 4)


def payload(seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(FMT.num_elements, generator=generator).numpy().tobytes()


def blob(key: bytes, seed: int = 0, root: bytes = ROOT) -> bytes:
    return encode_block(root, key, FMT, payload(seed))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = start_redis(tmp_path)
    yield server
    server.kill()


# ---------------------------------------------------------------------------- codec


def test_codec_round_trip_is_byte_exact() -> None:
    key = keys(1)[0]
    data = payload(1)
    decoded = decode_block(encode_block(ROOT, key, FMT, data), ROOT, key, FMT)
    assert bytes(decoded.payload) == data
    assert decoded.key == key


def test_a_frame_filled_in_place_is_the_same_block_as_an_encoded_one() -> None:
    key, data = keys(1)[0], payload(2)
    frame = memoryview(bytearray(HEADER_BYTES + len(data)))
    frame[HEADER_BYTES:] = data
    assert bytes(frame_block(frame, ROOT, key, FMT)) == encode_block(ROOT, key, FMT, data)
    assert bytes(decode_block(frame, ROOT, key, FMT).payload) == data


@pytest.mark.parametrize("offset", [0, 10, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 100, -1])
def test_codec_detects_a_flipped_byte_anywhere(offset: int) -> None:
    key = keys(1)[0]
    damaged = bytearray(blob(key))
    damaged[offset] ^= 0x40
    with pytest.raises(BlockCorruptError):
        decode_block(damaged, ROOT, key, FMT)


def test_codec_detects_truncation_and_garbage() -> None:
    key = keys(1)[0]
    whole = blob(key)
    for damaged in (whole[:-1], whole[: HEADER_BYTES - 3], b"", whole + b"\x00", os.urandom(len(whole))):
        with pytest.raises(BlockCorruptError):
            decode_block(damaged, ROOT, key, FMT)


def test_codec_rejects_another_namespace_even_under_the_same_key() -> None:
    key = keys(1)[0]
    other_root = NAMESPACE.with_salt("tenant-b").root_key()
    foreign = blob(key, root=other_root)  # a key collision: same key, written under another namespace
    with pytest.raises(BlockMismatchError):
        decode_block(foreign, ROOT, key, FMT)
    with pytest.raises(BlockMismatchError):
        decode_block(blob(key), ROOT, keys(2)[1], FMT)
    with pytest.raises(BlockMismatchError):
        decode_block(blob(key), ROOT, key, BlockFormat("bfloat16", FMT.shape))
    with pytest.raises(BlockMismatchError):
        decode_block(blob(key), ROOT, key, BlockFormat("float32", (2, 2, 4, 4, 4)))


# ---------------------------------------------------------------------------- KV copy out of / into the cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_blocks_round_trip_through_the_codec_byte_exact(dtype: torch.dtype) -> None:
    block_size, num_blocks = 4, 6
    caches = [torch.randn(2, num_blocks * block_size, 2, 8).to(dtype) for _ in range(3)]
    host = read_blocks(caches, block_size, [4, 1])
    assert host.shape == (2, *block_shape(caches, block_size))
    fmt = BlockFormat(str(dtype).removeprefix("torch."), block_shape(caches, block_size))
    raw = host.view(torch.uint8).reshape(2, -1).numpy()
    blobs = [encode_block(ROOT, key, fmt, memoryview(row)) for key, row in zip(keys(2), raw)]
    decoded = [bytearray(decode_block(b, ROOT, k, fmt).payload) for b, k in zip(blobs, keys(2))]
    restored = torch.stack([torch.frombuffer(d, dtype=torch.uint8) for d in decoded]).view(dtype).view(host.shape)
    targets = [torch.zeros_like(c) for c in caches]
    write_blocks(targets, block_size, [0, 5], restored)
    for source, target in zip(caches, targets):
        slots = lambda b: slice(b * block_size, (b + 1) * block_size)  # noqa: E731
        assert torch.equal(target[:, slots(0)].view(torch.uint8), source[:, slots(4)].view(torch.uint8))
        assert torch.equal(target[:, slots(5)].view(torch.uint8), source[:, slots(1)].view(torch.uint8))
        assert not target[:, slots(1)].any()


# ---------------------------------------------------------------------------- memory tier


def test_memory_tier_keeps_a_byte_budget_evicting_least_recently_used() -> None:
    ks = keys(4)
    tier = MemoryTier(capacity_bytes=3 * len(blob(ks[0])))
    tier.put_many([(k, blob(k)) for k in ks[:3]])
    assert tier.get_prefix(ks[:1], FOREVER) == [blob(ks[0])]  # ks[0] is now most recently used
    tier.put_many([(ks[3], blob(ks[3]))])
    assert len(tier) == 3 and tier.used_bytes <= tier.capacity_bytes
    assert not tier.contains(ks[1]) and tier.contains(ks[0])
    assert tier.stats.snapshot().evictions == 1


def test_tiers_return_only_the_leading_run_of_hits() -> None:
    ks = keys(4)
    tier = MemoryTier(1 << 20)
    tier.put_many([(k, blob(k)) for k in (ks[0], ks[1], ks[3])])
    assert tier.get_prefix(ks, FOREVER) == [blob(ks[0]), blob(ks[1])]


# ---------------------------------------------------------------------------- disk tier


def test_disk_tier_survives_a_restart_with_its_lru_order(tmp_path: Path) -> None:
    ks = keys(3)
    size = len(blob(ks[0]))
    tier = DiskTier(tmp_path, capacity_bytes=3 * size)
    for k in ks:
        tier.put_many([(k, blob(k))])
        time.sleep(0.01)  # distinct modification times, which order the rebuilt index
    tier.get_prefix(ks[:1], FOREVER)  # refreshes ks[0]
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "half-written.kvb.123.tmp").write_bytes(b"partial")
    reopened = DiskTier(tmp_path, capacity_bytes=3 * size)
    assert len(reopened) == 3 and reopened.used_bytes == 3 * size
    assert not list(tmp_path.glob("*/*.tmp"))
    # Reads refresh what they read, so the contents are checked only after the order has been.
    smaller = DiskTier(tmp_path, capacity_bytes=2 * size)  # rebuilt over budget: the oldest goes
    assert not smaller.contains(ks[1]) and smaller.contains(ks[0]) and smaller.contains(ks[2])
    assert not smaller.path_of(ks[1]).exists()
    assert smaller.get_prefix(ks[:1], FOREVER) == [blob(ks[0])]
    assert smaller.get_prefix(ks[2:], FOREVER) == [blob(ks[2])]


def test_disk_tier_writes_atomically_and_never_leaves_temp_files(tmp_path: Path) -> None:
    ks = keys(8)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 30)
    tier.put_many([(k, blob(k, seed=i)) for i, k in enumerate(ks)])
    for i, k in enumerate(ks):
        assert tier.path_of(k).read_bytes() == blob(k, seed=i)
    assert not list(tmp_path.glob("*/*.tmp"))
    assert tier.stats.snapshot().blocks_written == 8


def test_disk_tier_stops_writing_on_io_errors_and_keeps_serving(tmp_path: Path) -> None:
    ks = keys(2)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 30)
    tier.put_many([(ks[0], blob(ks[0]))])
    blocked = tier.path_of(ks[1]).parent
    blocked.write_bytes(b"a file where the shard directory should be")  # every write there fails
    tier.put_many([(ks[1], blob(ks[1]))])
    assert tier.stats.snapshot().errors == 1
    assert not tier.contains(ks[1])
    tier.put_many([(ks[1], blob(ks[1]))])  # paused: not even tried
    assert tier.stats.snapshot().errors == 1
    assert tier.get_prefix(ks, FOREVER) == [blob(ks[0])]


def test_a_load_deadline_moves_back_for_each_block_the_tiers_bring(tmp_path: Path) -> None:
    deadline = LoadDeadline(time.monotonic() - 1.0, extension_s_per_block=0.6)
    assert deadline.passed()
    deadline.count(2)  # two blocks brought: 1.2 s later than it was
    assert not deadline.passed()
    ks = keys(4)
    disk = DiskTier(tmp_path, capacity_bytes=1 << 30)
    disk.put_many([(k, blob(k)) for k in ks])
    assert disk.get_prefix(ks, LoadDeadline(time.monotonic() - 1.0, 10.0)) == []  # passed before the first block
    earned = LoadDeadline(time.monotonic() - 1.0, 10.0, loaded=1)  # an earlier tier's block keeps it open
    assert disk.get_prefix(ks, earned) == [blob(k) for k in ks] and earned.loaded == 5
    memory = MemoryTier(1 << 30)
    memory.put_many([(ks[0], blob(ks[0]))])
    across = LoadDeadline(time.monotonic() + 60, 1.0)
    store = TieredStore([memory, DiskTier(tmp_path, capacity_bytes=1 << 30)])
    assert len(store.load_prefix(ROOT, ks, FMT, across)) == 4 and across.loaded == 4  # both tiers' blocks count
    store.close()


def test_store_drops_and_removes_a_corrupt_disk_file(tmp_path: Path) -> None:
    ks = keys(3)
    disk = DiskTier(tmp_path, capacity_bytes=1 << 30)
    disk.put_many([(k, blob(k, seed=i)) for i, k in enumerate(ks)])
    path = disk.path_of(ks[1])
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 1
    path.write_bytes(damaged)
    store = TieredStore([DiskTier(tmp_path, capacity_bytes=1 << 30)])
    found = store.load_prefix(ROOT, ks, FMT, FOREVER)
    assert [bytes(b.payload) for b in found] == [payload(0)]
    assert store.snapshot().tiers["disk"].corrupt == 1
    assert not path.exists()
    store.close()


# ---------------------------------------------------------------------------- redis tier


def test_redis_tier_round_trip_with_ttl(redis_server: RedisProcess) -> None:
    ks = keys(40)  # more than one pipelined batch
    tier = RedisTier(redis_server.url, ttl_s=600, batch_blocks=16)
    tier.put_many([(k, blob(k, seed=i)) for i, k in enumerate(ks)])
    assert tier.get_prefix(ks, FOREVER) == [blob(k, seed=i) for i, k in enumerate(ks)]
    assert 0 < redis_server.client().ttl(RedisTier.redis_key(ks[0])) <= 600
    redis_server.client().delete(RedisTier.redis_key(ks[20]))
    assert len(tier.get_prefix(ks, FOREVER)) == 20
    tier.close()


def test_redis_tier_works_against_a_redis_cluster(tmp_path: Path) -> None:
    nodes = start_redis_cluster(tmp_path)
    try:
        ks = keys(24)  # spread over the cluster's hash slots, so every pipeline spans nodes
        tier = RedisTier(f"redis://127.0.0.1:{nodes[0].port}", cluster=True, batch_blocks=8)
        tier.put_many([(k, blob(k, seed=i)) for i, k in enumerate(ks)])
        assert tier.get_prefix(ks, FOREVER) == [blob(k, seed=i) for i, k in enumerate(ks)]
        assert sum(node.client().dbsize() for node in nodes) == 24 + 1  # and the store's epoch marker
        assert min(node.client().dbsize() for node in nodes) > 0
        assert tier.stats.snapshot().errors == 0
        tier.close()
    finally:
        for node in nodes:
            node.kill()


def test_store_drops_and_deletes_a_corrupt_redis_value(redis_server: RedisProcess) -> None:
    ks = keys(2)
    tier = RedisTier(redis_server.url)
    tier.put_many([(k, blob(k)) for k in ks])
    redis_server.client().setrange(RedisTier.redis_key(ks[0]), HEADER_BYTES + 7, b"\xff")
    store = TieredStore([tier])
    assert store.load_prefix(ROOT, ks, FMT, FOREVER) == []
    assert store.snapshot().tiers["redis"].corrupt == 1
    assert not redis_server.client().exists(RedisTier.redis_key(ks[0]))
    store.close()


def test_redis_down_is_a_miss_then_reconnects(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    ks = keys(2)
    tier = RedisTier(server.url, timeout_s=0.5)
    tier.put_many([(k, blob(k)) for k in ks])
    server.kill()
    assert tier.get_prefix(ks, FOREVER) == []
    assert tier.stats.snapshot().errors == 1
    assert tier.get_prefix(ks, FOREVER) == []  # backing off: not even tried
    tier.put_many([(k, blob(k)) for k in ks])
    assert tier.stats.snapshot().errors == 1
    restarted = start_redis(tmp_path, port=server.port)
    try:
        deadline = time.monotonic() + 10
        while not tier.available and time.monotonic() < deadline:
            time.sleep(0.05)
        tier.put_many([(k, blob(k)) for k in ks])
        assert tier.get_prefix(ks, FOREVER) == [blob(k) for k in ks]
    finally:
        restarted.kill()


# ---------------------------------------------------------------------------- tiered store


def test_store_reads_tier_by_tier_and_promotes_hits(tmp_path: Path) -> None:
    ks = keys(4)
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 30)
    memory.put_many([(ks[0], blob(ks[0]))])
    disk.put_many([(k, blob(k)) for k in ks[:3]])
    store = TieredStore([memory, disk])
    found = store.load_prefix(ROOT, ks, FMT, FOREVER)
    assert [b.key for b in found] == ks[:3]
    snap = store.snapshot()
    assert (snap.tiers["memory"].hits, snap.tiers["memory"].misses) == (1, 1)
    assert (snap.tiers["disk"].hits, snap.tiers["disk"].misses) == (2, 1)
    assert store.flush()
    assert memory.contains(ks[1]) and memory.contains(ks[2])
    store.close()


def test_store_writes_behind_to_every_tier_and_drops_when_the_queue_is_full(tmp_path: Path) -> None:
    ks = keys(3)
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path, 1 << 30)
    store = TieredStore([memory, disk], queue_bytes=1 << 20)
    accepted = store.submit([BlockWrite(ROOT, k, FMT, payload=memoryview(payload(i))) for i, k in enumerate(ks)])
    assert accepted == 3 and store.flush()
    assert [bytes(b.payload) for b in store.load_prefix(ROOT, ks, FMT, FOREVER)] == [payload(i) for i in range(3)]
    assert disk.get_prefix(ks, FOREVER) == [blob(k, seed=i) for i, k in enumerate(ks)]
    tiny_queue = TieredStore([MemoryTier(1 << 20)], queue_bytes=len(payload(0)) - 1)
    assert tiny_queue.submit([BlockWrite(ROOT, ks[0], FMT, payload=memoryview(payload(0)))]) == 0
    assert tiny_queue.snapshot().queue_dropped_blocks == 1
    store.close()
    tiny_queue.close()


def test_store_writes_frames_to_every_tier_as_encoded_blocks(tmp_path: Path, redis_server: RedisProcess) -> None:
    ks = keys(3)
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path / "disk", 1 << 30)
    redis_tier = RedisTier(redis_server.url, ttl_s=60)
    store = TieredStore([memory, disk, redis_tier])
    step = bytearray(b"".join(bytes(HEADER_BYTES) + payload(number) for number in range(len(ks))))
    width = len(step) // len(ks)
    frames = [memoryview(step)[number * width : (number + 1) * width] for number in range(len(ks))]
    assert store.submit([BlockWrite(ROOT, key, FMT, frame=frame) for key, frame in zip(ks, frames)]) == 3
    assert store.flush()
    expected = [blob(key, seed=number) for number, key in enumerate(ks)]
    for tier in (memory, disk, redis_tier):
        assert [bytes(found) for found in tier.get_prefix(ks, FOREVER)] == expected, tier.name
    assert [bytes(b.payload) for b in store.load_prefix(ROOT, ks, FMT, FOREVER)] == [payload(i) for i in range(3)]
    step[:] = bytes(len(step))  # the step's buffer reused: the memory tier kept copies of its own
    assert [bytes(found) for found in memory.get_prefix(ks, FOREVER)] == expected
    store.close()


def test_store_never_serves_a_block_of_another_namespace(tmp_path: Path) -> None:
    ks = keys(2)
    other_root = KeyNamespace("tiny", "digest0", "bfloat16", 4).root_key()
    disk = DiskTier(tmp_path, 1 << 30)
    disk.put_many([(k, blob(k, root=other_root)) for k in ks])  # as if the chained keys collided
    store = TieredStore([disk])
    assert store.load_prefix(ROOT, ks, FMT, FOREVER) == []
    assert store.snapshot().tiers["disk"].mismatched == 1
    store.close()


def test_tier_config_parses_specs_and_rejects_bad_ones(tmp_path: Path) -> None:
    assert KVTierConfig.from_spec(None).tiers == ("memory",)  # type: ignore[union-attr]  # nothing on disk unasked
    on_disk = KVTierConfig.from_spec(None, disk_dir=str(tmp_path))
    assert on_disk is not None and on_disk.tiers == ("memory", "disk") and str(tmp_path) in on_disk.describe()
    shared = KVTierConfig.from_spec(None, redis_url="rediss://:hunter2@kv:6380/0")
    assert shared is not None and shared.tiers == ("memory", "redis")
    assert "hunter2" not in shared.describe() and "kv:6380" in shared.describe()
    assert KVTierConfig.from_spec("none") is None
    assert KVTierConfig.from_spec("disk", disk_dir=str(tmp_path)).tiers == ("disk",)  # type: ignore[union-attr]
    for bad in ("memory,tape", "redis", "disk,disk"):
        with pytest.raises(ValueError):
            KVTierConfig.from_spec(bad)
    with pytest.raises(ValueError, match="min speedup must be >= 0"):
        KVTierConfig(tiers=("memory",), load_min_speedup=-1.0)

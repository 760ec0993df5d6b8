"""The parts of kvyard's vLLM connector that run without vLLM: its configuration, what the scheduler knows the tiers
hold, the per-step plan of loads and saves, and the copy between a paged KV cache and kvyard's block payloads.
(tests/test_vllm_connector.py runs the connector inside real vLLM processes.)"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis_utils import RedisProcess, start_redis

from kvyard.integrations.block_plan import BlockPlanner, ScheduledRequest
from kvyard.integrations.connector_config import connector_config
from kvyard.integrations.paged_blocks import PagedBlocks
from kvyard.integrations.tier_presence import TierPresence
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.kvcache.codec import HEADER_BYTES, BlockFormat, encode_block
from kvyard.kvcache.config import KVTierConfig
from kvyard.kvcache.disk_tier import DiskTier
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.redis_tier import RedisTier
from kvyard.kvcache.tiered_store import TieredStore

BLOCK = 4
NAMESPACE = KeyNamespace("model", "digest", "vllm-cpu:float32:auto", BLOCK)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


# ---------------------------------------------------------------------- configuration


def test_the_extra_config_builds_the_tier_it_names(tmp_path: Path) -> None:
    config = connector_config({"tiers": "memory, disk", "memory_gb": 1, "disk_dir": str(tmp_path), "other": 1})
    assert config.tier.active_tiers == ("memory", "disk") and config.tier.memory_gb == 1
    assert config.ignored == ("other",)
    assert connector_config({"tiers": ["disk"]}).tier.active_tiers == ("disk",)
    assert connector_config({}).tier.active_tiers == ("memory",), "nothing on disk or elsewhere unless asked"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"memory_gb": "2"}, "memory_gb must be a number"),
        ({"redis_ttl_s": 1.5}, "redis_ttl_s must be an integer"),
        ({"disk_dir": 3}, "disk_dir must be a string"),
        ({"load_deadline_s": True}, "load_deadline_s"),
        ({"tiers": ""}, "tiers must be"),
        ({"tiers": "memory,tape"}, "kv tiers must be"),
        ({"tiers": "redis"}, "needs a URL"),
    ],
)
def test_a_wrong_value_stops_vllm_naming_the_key(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named) as error:
        connector_config(extra)
    assert "kv_connector_extra_config" in str(error.value)


# ---------------------------------------------------------------------- what the scheduler knows the tiers hold


def blob(key: bytes) -> bytes:
    return encode_block(NAMESPACE.root_key(), key, BlockFormat("uint8", (4,)), b"abcd")


def test_presence_follows_the_workers_reports_its_disk_files_and_the_shared_store(
    tmp_path: Path, store: RedisProcess
) -> None:
    keys = chain_block_keys(NAMESPACE.root_key(), list(range(6 * BLOCK)), BLOCK)
    disk = DiskTier(tmp_path, 1 << 20)
    disk.put_many([(keys[2], blob(keys[2]))])  # written by an earlier process: no report says so
    shared = RedisTier(store.url)
    shared.put_many([(key, blob(key)) for key in keys[3:5]])
    config = KVTierConfig(tiers=("memory", "disk", "redis"), disk_dir=str(tmp_path), redis_url=store.url)
    presence = TierPresence(config, RedisTier(store.url))
    assert presence.leading(keys) == []
    presence.apply(keys[:2], [])
    assert presence.leading(keys) == ["memory", "memory", "disk", "redis", "redis"]
    presence.apply([], [keys[1]])
    assert presence.leading(keys) == ["memory"]
    presence.apply([keys[1]], [], snapshot=True)
    assert presence.leading(keys) == [] and presence.leading(keys[1:]) == ["memory", "disk", "redis", "redis"]
    store.client().flushall()
    assert presence.leading(keys[1:]) == ["memory", "disk"]
    presence.close()


def test_a_shared_store_that_is_down_holds_nothing(tmp_path: Path) -> None:
    down = RedisTier("redis://127.0.0.1:9/0", timeout_s=0.2)
    keys = chain_block_keys(NAMESPACE.root_key(), list(range(2 * BLOCK)), BLOCK)
    assert down.leading_held(keys) == 0


# ---------------------------------------------------------------------- the per-step plan


class Tiers(TierPresence):
    """A presence whose shared store holds `held` (the real lookups are tested above)."""

    def __init__(self, held: set[bytes]) -> None:
        super().__init__(KVTierConfig(tiers=("memory",)))
        self.held = held

    def leading(self, keys):  # type: ignore[no-untyped-def]
        count = next((index for index, key in enumerate(keys) if key not in self.held), len(keys))
        return ["redis"] * count


def test_a_request_is_offered_the_leading_blocks_held_past_vllms_own_and_never_its_last_token() -> None:
    tokens = list(range(1000, 1000 + 5 * BLOCK))
    keys = chain_block_keys(NAMESPACE.root_key(), tokens, BLOCK)
    planner = BlockPlanner(NAMESPACE, Tiers(set(keys)), load=True, save=True)
    assert planner.matched_tokens("r", "", tokens, 0) == 4 * BLOCK, "the fifth block holds the last token"
    assert planner.matched_tokens("r", "", tokens, 2 * BLOCK) == 2 * BLOCK
    assert planner.matched_tokens("r", "", tokens, 3) == 0, "vLLM passes block-aligned counts"
    assert planner.matched_tokens("s", "tenant", tokens, 0) == 0, "a salt is another namespace"
    partial = BlockPlanner(NAMESPACE, Tiers(set(keys[:2])), load=True, save=True)
    assert partial.matched_tokens("r", "", tokens, 0) == 2 * BLOCK
    assert BlockPlanner(NAMESPACE, Tiers(set(keys)), load=False, save=True).matched_tokens("r", "", tokens, 0) == 0


def test_a_step_loads_what_was_allocated_and_saves_each_computed_block_once() -> None:
    tokens = list(range(7 * BLOCK + 2))
    keys = chain_block_keys(NAMESPACE.root_key(), tokens, BLOCK)
    planner = BlockPlanner(NAMESPACE, Tiers(set(keys[:3])), load=True, save=True)
    block_ids = [40, 41, 42, 43, 44, 45, 46, 47]
    assert planner.matched_tokens("r", "", tokens, BLOCK) == 2 * BLOCK  # vLLM's cache had block 0
    planner.allocated("r", 2 * BLOCK)
    steps = [
        ScheduledRequest("r", 3 * BLOCK + 1),
        ScheduledRequest("r", 6 * BLOCK),
        ScheduledRequest("r", 6 * BLOCK + 3),
    ]
    plans = [planner.plan_step([step], lambda _: tokens, lambda _: block_ids) for step in steps]
    load = plans[0].loads[0]
    assert load.keys == tuple(keys[1:3]) and load.block_ids == (41, 42) and load.root_key == NAMESPACE.root_key()
    assert [len(plan.loads) for plan in plans] == [1, 0, 0]
    assert [[save.keys for save in plan.saves] for plan in plans] == [[], [tuple(keys[3:6])], []]
    assert plans[1].saves[0].block_ids == (43, 44, 45)
    planner.finished("r")
    assert planner.plan_step(steps[:1], lambda _: tokens, lambda _: block_ids).saves == []


def test_blocks_the_workers_tiers_hold_are_not_saved_again() -> None:
    tokens = list(range(3 * BLOCK))
    keys = chain_block_keys(NAMESPACE.root_key(), tokens, BLOCK)
    presence = Tiers(set())
    presence.apply([keys[1]], [])
    planner = BlockPlanner(NAMESPACE, presence, load=True, save=True)
    planner.matched_tokens("r", "", tokens, 0)
    planner.allocated("r", 0)
    plan = planner.plan_step([ScheduledRequest("r", 3 * BLOCK)], lambda _: tokens, lambda _: [7, 8, 9])
    assert [(save.keys, save.block_ids) for save in plan.saves] == [((keys[0], keys[2]), (7, 9))]


# ---------------------------------------------------------------------- paged KV cache <-> block payloads


@pytest.mark.parametrize("gather_on_device", [False, True], ids=["per layer", "gathered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["blocks first", "kv first"])
def test_blocks_round_trip_byte_exact_between_caches(dtype: torch.dtype, layout: str, gather_on_device: bool) -> None:
    def cache() -> dict[str, torch.Tensor]:
        shape = (10, 2, BLOCK, 16) if layout == "blocks first" else (2, 10, BLOCK, 2, 8)
        return {f"layers.{n}.attn": torch.randn(shape).to(dtype) for n in range(3)}

    source, target = cache(), cache()
    reader, writer = PagedBlocks(source, 10), PagedBlocks(target, 10)
    assert reader.format == writer.format and reader.format.shape[0] == 3
    reader.gather_on_device = gather_on_device  # the GPU path (one gather, one transfer) runs on a CPU too
    frames = reader.read([2, 7])
    assert all(len(frame) == HEADER_BYTES + reader.block_bytes for frame in frames)
    payloads = [bytes(frame[HEADER_BYTES:]) for frame in frames]
    assert all(len(payload) == reader.block_bytes for payload in payloads)
    writer.write([5, 1], payloads)
    dim = 0 if layout == "blocks first" else 1
    for name in source:
        for source_block, target_block in ((2, 5), (7, 1)):
            original = source[name].select(dim, source_block)
            assert torch.equal(original.view(torch.uint8), target[name].select(dim, target_block).view(torch.uint8))
    assert not torch.equal(source["layers.0.attn"].select(dim, 0), target["layers.0.attn"].select(dim, 0))


def test_a_cache_it_cannot_read_as_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="alike"):
        PagedBlocks({"a": torch.zeros(4, 2), "b": torch.zeros(4, 3)}, 4)
    with pytest.raises(ValueError, match="counts its 9 blocks"):
        PagedBlocks({"a": torch.zeros(4, 2)}, 9)
    with pytest.raises(ValueError, match="bytes for"):
        PagedBlocks({"a": torch.zeros(4, 2)}, 4).write([1], [b"\x00"])


def test_blocks_a_step_saves_count_as_held_before_the_worker_reports_them() -> None:
    """The worker's report rides on a later step, which may come after the next request's lookup."""
    tokens = list(range(3 * BLOCK + 1))
    keys = chain_block_keys(NAMESPACE.root_key(), tokens, BLOCK)
    presence = TierPresence(KVTierConfig(tiers=("memory",)))
    planner = BlockPlanner(NAMESPACE, presence, load=True, save=True)
    assert planner.matched_tokens("r", "", tokens, 0) == 0
    planner.allocated("r", 0)
    planner.plan_step([ScheduledRequest("r", 3 * BLOCK + 1)], lambda _: tokens, lambda _: [1, 2, 3, 4])
    assert planner.matched_tokens("s", "", tokens, 0) == 3 * BLOCK
    presence.apply([], [keys[1]])  # the worker did not find it when it loaded it
    assert planner.matched_tokens("t", "", tokens, 0) == BLOCK


def test_without_tiers_of_its_own_saved_blocks_are_looked_up_in_the_shared_store(store: RedisProcess) -> None:
    """With Redis as the only tier, a block the step saved is offered only while Redis holds it: after a flush,
    nothing is offered (a block counted as held by no tier was loaded, failed and computed again)."""
    tokens = list(range(3 * BLOCK + 1))
    keys = chain_block_keys(NAMESPACE.root_key(), tokens, BLOCK)
    presence = TierPresence(KVTierConfig(tiers=("redis",), redis_url=store.url), RedisTier(store.url))
    planner = BlockPlanner(NAMESPACE, presence, load=True, save=True)
    planner.matched_tokens("r", "", tokens, 0)
    planner.allocated("r", 0)
    saves = planner.plan_step([ScheduledRequest("r", 3 * BLOCK + 1)], lambda _: tokens, lambda _: [1, 2, 3, 4]).saves
    assert [key for save in saves for key in save.keys] == keys
    assert planner.matched_tokens("s", "", tokens, 0) == 0  # not written yet
    RedisTier(store.url).put_many([(key, blob(key)) for key in keys])
    assert planner.matched_tokens("t", "", tokens, 0) == 3 * BLOCK
    store.client().flushall()
    assert planner.matched_tokens("u", "", tokens, 0) == 0
    presence.close()


def test_the_wait_for_a_prefill_replica_is_configured_and_checked() -> None:
    assert connector_config({"remote_prefill_wait_s": 5}).remote_prefill_wait_s == 5.0
    assert connector_config({}).remote_prefill_wait_s == 60.0
    for wrong in (0, "5", True):
        with pytest.raises(ValueError, match="remote_prefill_wait_s must be a positive number"):
            connector_config({"remote_prefill_wait_s": wrong})


def test_the_writers_cpus_are_a_cpu_list() -> None:
    assert connector_config({"writer_cpus": "0,2-3"}).writer_cpus == frozenset({0, 2, 3})
    assert connector_config({}).writer_cpus is None, "by default the writer stays where the worker starts it"
    for wrong in ("", "a", "3-1", 2, "-1"):
        with pytest.raises(ValueError, match="writer_cpus must be a CPU list"):
            connector_config({"writer_cpus": wrong})


def test_the_tier_writer_runs_on_the_cpus_it_is_given() -> None:
    before = {thread.ident for thread in threading.enumerate()}
    tiered = TieredStore([MemoryTier(1 << 20)], writer_cpus=frozenset({0}))
    try:
        (thread,) = [thread for thread in threading.enumerate() if thread.ident not in before]  # this store's writer
        assert thread.name == "kvyard-kv-writer" and thread.native_id is not None
        deadline = time.monotonic() + 5
        while os.sched_getaffinity(thread.native_id) != {0}:
            assert time.monotonic() < deadline, os.sched_getaffinity(thread.native_id)
            time.sleep(0.01)
    finally:
        tiered.close()

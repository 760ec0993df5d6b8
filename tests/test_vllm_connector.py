"""kvyard's KV tier inside real vLLM processes (vLLM's CPU build serving the demo model) through `KvyardConnector`:
a fresh replica serves another replica's prompt from Redis, a restarted one from its own disk, with vLLM reporting
the loaded tokens as cached and the greedy text unchanged; a corrupt block, a lost Redis or a replica killed while
it saved is computed instead; another tenant's salt or another dtype never loads a block.

The vLLM servers come from `.venv-vllm` (`bash scripts/setup.sh --vllm`; `--tests` makes it too). Without it these
tests are skipped, except under CI, where a missing vLLM is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import zmq
from redis_utils import RedisProcess, start_redis
from router_utils import admin, labelled_metric, replica_state, start_router, wait_for
from transformers import AutoTokenizer

from kvyard.api.engine_kv_events import EventBatchDecoder, StoredBlocks
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.kvcache.redis_tier import KEY_PREFIX
from kvyard.models.checkpoint import model_digest
from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.vllm_replicas import VLLM_BLOCK_SIZE, VllmReplica, start_vllm, vllm_python, wait_ready

MODEL = "kvyard-demo"
BLOCK = VLLM_BLOCK_SIZE

if vllm_python() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the vLLM tests: `bash scripts/setup.sh --tests` makes .venv-vllm")
    pytest.skip("no .venv-vllm here: run `bash scripts/setup.sh --vllm`", allow_module_level=True)


@dataclass
class Pair:
    """Two replicas sharing one Redis, each with its own disk tier."""

    scratch: Path
    store: RedisProcess
    a: VllmReplica
    b: VllmReplica

    def restart_store(self) -> None:
        """As a Redis that lost its memory: the same port, nothing in it."""
        self.store.kill()
        self.store = start_redis(self.scratch, port=self.store.port)


def transfer_config(scratch: Path, name: str, store: RedisProcess) -> str:
    extra = {
        "tiers": "memory,disk,redis",
        "memory_gb": 0.25,
        "disk_dir": str(scratch / f"disk-{name}"),
        "disk_gb": 1,
        "redis_url": store.url,
        "redis_timeout_s": 2.0,  # a loaded 2-core runner can take over half a second on one round trip
        "remote_prefill_wait_s": 60,
    }
    return json.dumps(
        {
            "kv_connector": "KvyardConnector",
            "kv_connector_module_path": "kvyard.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    )


def start(scratch: Path, name: str, store: RedisProcess, cpu: int, *extra: str) -> VllmReplica:
    """Both replicas publish vLLM's KV events (without a replay socket)."""
    cores = os.cpu_count() or 1
    return start_vllm(
        DEMO_MODEL_DIR,
        scratch,
        served_name=MODEL,
        events=True,
        replay=False,
        cpus=str(cpu % cores),
        extra=("--kv-transfer-config", transfer_config(scratch, name, store), *extra),
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    scratch = tmp_path_factory.mktemp("vllm-connector")
    store = start_redis(scratch)
    replicas = [start(scratch, name, store, cpu) for cpu, name in enumerate("ab")]
    pair = Pair(scratch, store, *replicas)
    try:
        wait_ready(replicas)
        yield pair
    finally:
        for replica in (pair.a, pair.b):
            replica.stop()
        pair.store.kill()


def complete(replica: VllmReplica, prompt: str, **extra: Any) -> tuple[str, int, int]:
    """Greedy text, prompt tokens, and the tokens vLLM says it did not compute (its cache plus the connector's)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
    response = httpx.post(f"{replica.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    usage = answer["usage"]
    return answer["choices"][0]["text"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def prompt(topic: str, repeats: int = 30) -> str:
    return f"{topic}: You write short Python functions for file paths and check that each path exists. " * repeats


def loadable(prompt_tokens: int) -> int:
    """Tokens of a prompt the tier can give: its full blocks, never the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def stored_keys(text: str, salt: str = "") -> list[str]:
    """The Redis keys of a prompt's full blocks, under the namespace the connector gives the demo model."""
    token_ids = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)(text)["input_ids"]
    namespace = KeyNamespace(MODEL, model_digest(DEMO_MODEL_DIR), "vllm-cpu:float32:auto", BLOCK, cache_salt=salt)
    return [KEY_PREFIX + key.hex() for key in chain_block_keys(namespace.root_key(), token_ids, BLOCK)]


def settled(client: redis.Redis, keys: list[str], timeout: float = 30.0) -> bool:
    """Whether the writer thread behind the step put every block of the prompt into Redis within `timeout`."""
    deadline = time.monotonic() + timeout
    while sum(client.exists(key) for key in keys) < len(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def settle(client: redis.Redis, keys: list[str]) -> None:
    assert settled(client, keys), "the blocks never reached Redis"


def test_a_fresh_replica_serves_another_replicas_prompt_from_redis(pair: Pair) -> None:
    text = prompt("Redis")
    computed, length, cached = complete(pair.a, text)
    assert cached == 0
    settle(pair.store.client(), stored_keys(text))
    loaded, _, cached = complete(pair.b, text)
    assert cached == loadable(length) > 10 * BLOCK
    assert loaded == computed


def test_what_the_tier_holds_is_announced_in_vllms_kv_events(pair: Pair) -> None:
    """The blocks the tier gained are announced as vLLM announces its device cache's, under the same hashes, with
    medium KVYARD, so a router following the replica's events sees its tier. (The worker reports what its tiers
    gained with a step's output: a write finished after the last step is announced with the next one.)"""
    text = prompt("Events")
    context = zmq.Context.instance()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{pair.a.events_port}")
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    device: dict[object, list[int]] = {}  # block hash -> tokens, in the order vLLM announced them
    tier: dict[object, list[int]] = {}
    try:
        _, length, _ = complete(pair.a, text)
        decoder, deadline = EventBatchDecoder(), time.monotonic() + 30
        while len(device) < length // BLOCK or not set(list(device)[: length // BLOCK]) <= set(tier):
            assert time.monotonic() < deadline, f"{len(tier)} tier blocks announced, {len(device)} device blocks"
            if subscriber.poll(500):
                for event in decoder.decode(subscriber.recv_multipart()).events:
                    if isinstance(event, StoredBlocks) and event.medium != "KVYARD_SHARED":
                        blocks = tier if event.medium == "KVYARD" else device
                        for number, block_hash in enumerate(event.hashes):
                            blocks[block_hash] = list(event.token_ids[number * BLOCK : (number + 1) * BLOCK])
            elif len(device) >= length // BLOCK:
                complete(pair.a, "Another step, to carry the worker's last report.")
    finally:
        subscriber.close(linger=0)
    token_ids = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)(text)["input_ids"]
    prompt_blocks = list(device)[: length // BLOCK]
    assert [token for block in prompt_blocks for token in tier[block]] == token_ids[: length // BLOCK * BLOCK]


def test_the_router_credits_every_replica_with_what_one_put_into_the_shared_store(pair: Pair) -> None:
    """`kvyard route` over both replicas, following their KV events and metrics: A's prompt, computed on A alone,
    reaches Redis; A announces those blocks with medium KVYARD_SHARED, and the router files them under the store
    both replicas' metrics name. With A drained, the router predicts B holds every full block of the prompt, and B
    loads them (vLLM reports them cached) and answers with A's text."""
    events = [f"tcp://127.0.0.1:{replica.events_port}" for replica in (pair.a, pair.b)]
    router = start_router(
        pair.scratch,
        [pair.a.url, pair.b.url],
        *(option for url in events for option in ("--replica-events", url)),
        "--policy",
        "cache_aware",
        "--log-level",
        "debug",
        timeout=120,
    )
    try:
        text = prompt("Shared store")
        computed, length, _ = complete(pair.a, text)
        settle(pair.store.client(), stored_keys(text))

        def store_announced() -> bool:
            listing = admin(router, "GET", "/admin/replicas").json()
            stores = {replica["shared_store"] for replica in listing["replicas"]}
            held = listing["shared_stores"].get(next(iter(stores)), 0) if len(stores) == 1 else 0
            if held < loadable(length) // BLOCK:
                complete(pair.a, "Another step, to carry the worker's last report.")
            return None not in stores and held >= loadable(length) // BLOCK

        wait_for(store_announced, 60, "A's blocks filed under the store both replicas use")
        admin(router, "POST", "/admin/replicas/drain", json={"url": pair.a.url}).raise_for_status()
        body = {"model": MODEL, "prompt": text, "max_tokens": 24, "temperature": 0}
        response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvyard-replica"] == pair.b.url
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable(length)
        assert response.json()["choices"][0]["text"] == computed
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        predicted = labelled_metric(metrics, "kvyard_router_predicted_cached_tokens_total", replica=pair.b.url)
        assert predicted == loadable(length), router.log()[-4000:]
        # B's metrics count what it loaded from the store, and the router takes B's seconds per block from them.
        loaded = labelled_metric(
            httpx.get(f"{pair.b.url}/metrics", timeout=10).text, "vllm:kvyard_tier_loaded_blocks_total", medium="shared"
        )
        assert loaded >= loadable(length) // BLOCK
        wait_for(
            lambda: replica_state(router, pair.b.url)["load"]["shared_tier_s_per_block"] > 0,
            10,
            "the router's figure of B's load seconds per shared block",
        )

        # Redis flushed: each replica's writer sees the store's new id when idle and reports it with its next step;
        # the router drops what it knew of the old store.
        old = replica_state(router, pair.b.url)["shared_store"]
        pair.store.client().flushall()
        time.sleep(2.0)
        for replica in (pair.a, pair.b):
            complete(replica, "A step, to carry the store's new id.")

        def moved() -> bool:
            listing = admin(router, "GET", "/admin/replicas").json()
            ids = {replica["shared_store"] for replica in listing["replicas"]}
            return old not in ids and len(ids) == 1 and old not in listing["shared_stores"]

        wait_for(moved, 15, "both replicas on the flushed store's new id, the old one forgotten")
    finally:
        router.stop()


def test_a_corrupt_block_is_dropped_and_computed_instead(pair: Pair) -> None:
    text = prompt("Corrupt")
    computed, length, _ = complete(pair.a, text)
    client = pair.store.client()
    keys = stored_keys(text)
    settle(client, keys)
    blob = bytearray(client.get(keys[4]) or b"")
    blob[-7] ^= 0x40  # one bit of the payload: the CRC must catch it
    client.set(keys[4], bytes(blob))
    answer, _, _ = complete(pair.b, text)  # vLLM's cached_tokens still counts what was offered, not what came
    assert answer == computed
    # B deletes the damaged block on load; its writer may already have stored the block it computed instead.
    assert client.get(keys[4]) != bytes(blob), "a corrupt block is removed from the store"
    log = pair.b.log()
    assert f"4 of {loadable(length) // BLOCK} blocks loaded, the rest is computed" in log
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in log


def test_another_tenants_salt_never_loads_its_blocks(pair: Pair) -> None:
    text = prompt("Tenant")
    computed, length, _ = complete(pair.a, text, cache_salt="tenant-one")
    settle(pair.store.client(), stored_keys(text, salt="tenant-one"))
    answer, _, cached = complete(pair.b, text, cache_salt="tenant-two")
    assert cached == 0 and answer == computed
    _, _, cached = complete(pair.b, text, cache_salt="tenant-one")
    assert cached == loadable(length)


def test_the_router_prefills_on_one_vllm_replica_and_decodes_on_the_other_through_the_tier(pair: Pair) -> None:
    """`kvyard route --prefill A --decode B`: both legs go out at once; B's connector waits for A's blocks to reach
    Redis, loads every full block of the prompt, and answers with the text A gives the prompt whole."""
    router = start_router(
        pair.scratch,
        [],
        "--prefill",
        pair.a.url,
        "--decode",
        pair.b.url,
        "--disaggregation",
        "always",
        "--health-timeout-s",
        "10",
        replicas_publish_events=False,
        timeout=120,
    )
    try:
        text = prompt("Disaggregated", repeats=40)
        body = {"model": MODEL, "prompt": text, "max_tokens": 24, "temperature": 0}
        response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvyard-replica"] == pair.b.url
        usage = response.json()["usage"]
        logs = f"A:\n{pair.a.log()[-3000:]}\nB:\n{pair.b.log()[-3000:]}"
        assert usage["prompt_tokens_details"]["cached_tokens"] == loadable(usage["prompt_tokens"]), logs
        unified, _, cached = complete(pair.a, text)
        assert cached > 0, "the prefill replica computed the prompt"
        assert response.json()["choices"][0]["text"] == unified
        assert "came from the prefill replica" not in pair.b.log()
    finally:
        router.stop()


def test_a_stalled_redis_is_computed_and_the_replica_stays_up(pair: Pair) -> None:
    """Redis stopped (SIGSTOP) while B serves a prompt A left there: B's lookup gives up after redis_timeout_s and
    computes the prompt, with A's text; Redis resumed, B loads from it again."""
    text = prompt("Stalled")
    computed, length, _ = complete(pair.a, text)
    settle(pair.store.client(), stored_keys(text))
    pair.store.process.send_signal(signal.SIGSTOP)
    try:
        answer, _, cached = complete(pair.b, text)
    finally:
        pair.store.process.send_signal(signal.SIGCONT)
    assert cached == 0 and answer == computed
    deadline = time.monotonic() + 60  # the tier backs off after a failure, then asks again
    for attempt in range(1000):  # a new prompt each time: B's own cache must not answer for Redis
        text = prompt(f"Resumed {attempt}")
        _, length, _ = complete(pair.a, text)
        # A's writer may have looked at the stopped Redis too: its tier backs off and drops what it writes meanwhile.
        written = settled(pair.store.client(), stored_keys(text), timeout=10)
        if written and complete(pair.b, text)[2] == loadable(length):
            break
        assert time.monotonic() < deadline, "B never read Redis again"
        time.sleep(1)


def test_a_lost_redis_is_computed_and_the_replica_stays_up(pair: Pair) -> None:
    text = prompt("Outage")
    computed, _, _ = complete(pair.a, text)
    settle(pair.store.client(), stored_keys(text))
    pair.store.kill()
    answer, _, cached = complete(pair.b, text)
    assert cached == 0 and answer == computed
    pair.restart_store()


def test_a_replica_killed_while_saving_restarts_and_serves_from_its_disk(pair: Pair) -> None:
    """A is killed right after answering (its writer may be mid-block) and restarted with an emptied Redis: what
    reached its disk is loaded, checked, and gives the same text; B restarted with another dtype loads nothing."""
    first = prompt("Redis")
    remembered, length, _ = complete(pair.a, first)
    last, last_length, _ = complete(pair.a, prompt("Killed", repeats=60))
    pair.a.kill()
    pair.b.stop()
    pair.restart_store()
    pair.a = start(pair.scratch, "a", pair.store, 0)
    pair.b = start(pair.scratch, "b", pair.store, 1, "--dtype", "bfloat16")
    wait_ready([pair.a, pair.b])
    answer, _, cached = complete(pair.a, first)
    assert cached == loadable(length) and answer == remembered
    answer, _, cached = complete(pair.a, prompt("Killed", repeats=60))
    assert answer == last and cached % BLOCK == 0 and cached <= loadable(last_length)
    _, _, cached = complete(pair.b, first)
    assert cached == 0, "a bfloat16 replica never takes float32 blocks"

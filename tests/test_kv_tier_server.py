"""The KV tier end to end: real `kvyard serve` processes and a real redis-server on loopback."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_utils import RedisProcess, start_redis
from server_utils import ADMIN, ServerProcess, start_server

from kvyard import LLM, SamplingParams
from kvyard.cli import main as cli_main
from kvyard.kvcache import KVTierConfig
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.kvcache.disk_tier import DiskTier
from kvyard.kvcache.redis_tier import RedisTier
from kvyard.models.loader import model_digest
from kvyard.testing.create_model import create_model

BLOCK_SIZE = 16
MAX_TOKENS = 8


def make_prompt(seed: int, length: int = 300) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 1000) for _ in range(length)]


PROMPT = make_prompt(0)
PROMPTS = (PROMPT, make_prompt(100))
FULL_PREFIX = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last prompt token is always computed


@dataclass(frozen=True)
class Completion:
    text: str
    cached_tokens: int


def complete(server: ServerProcess, prompt: list[int], cache_salt: str | None = None) -> Completion:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    details = result["usage"].get("prompt_tokens_details") or {}
    return Completion(result["choices"][0]["text"], details.get("cached_tokens") or 0)


def tier_metric(server: ServerProcess, name: str, tier: str) -> float:
    """The sample `name` of `tier`, whatever else labels it (the model served)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'tier="{tier}"' in line.split("}", 1)[0]:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f'{name}{{tier="{tier}"}}')


def wait_for_metric(server: ServerProcess, name: str, tier: str, minimum: float, timeout: float = 30) -> None:
    """Write-behind is asynchronous: wait until the tier has taken the blocks (a condition, not a timing)."""
    deadline = time.monotonic() + timeout
    while tier_metric(server, name, tier) < minimum:
        assert time.monotonic() < deadline, f"{name}{{tier={tier}}} stayed below {minimum}"
        time.sleep(0.1)


def prompt_keys(model_dir: Path, prompt: list[int]) -> list[bytes]:
    namespace = KeyNamespace(model_dir.name, model_digest(model_dir), "float32", BLOCK_SIZE)
    return chain_block_keys(namespace.root_key(), prompt, BLOCK_SIZE)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = start_redis(tmp_path)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def reference_texts(llama_dir: Path) -> list[str]:
    """Greedy outputs with no tier at all, for comparison."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [output.text for output in LLM(str(llama_dir)).generate(list(PROMPTS), params)]


def damage_disk_block(disk_dir: str, key: bytes) -> bytes:
    path = DiskTier(disk_dir, 1 << 30).path_of(key)
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01
    path.write_bytes(content)
    return bytes(content)


def test_disk_tier_survives_a_restart_and_drops_a_corrupt_file(
    llama_dir: Path, tmp_path: Path, reference_texts: list[str]
) -> None:
    disk = str(tmp_path / "kv")
    first_server = start_server(llama_dir, tmp_path, "--kv-disk-dir", disk)
    try:
        first = [complete(first_server, prompt) for prompt in PROMPTS]
    finally:
        first_server.stop()  # a graceful stop writes out whatever is still queued
    assert first == [Completion(text, 0) for text in reference_texts]
    assert f"KV tier: memory (2 GB) -> disk ({disk}, 32 GB)" in first_server.log()  # where blocks go, said
    damaged = damage_disk_block(disk, prompt_keys(llama_dir, PROMPTS[1])[5])

    second_server = start_server(llama_dir, tmp_path, "--kv-tier", "disk", "--kv-disk-dir", disk)
    try:
        assert complete(second_server, PROMPTS[0], cache_salt="another tenant") == Completion(reference_texts[0], 0)
        assert complete(second_server, PROMPTS[0]) == Completion(reference_texts[0], FULL_PREFIX)
        assert tier_metric(second_server, "kvyard_kv_tier_hits_total", "disk") == FULL_PREFIX // BLOCK_SIZE
        assert complete(second_server, PROMPTS[1]) == Completion(reference_texts[1], 5 * BLOCK_SIZE)
        assert tier_metric(second_server, "kvyard_kv_tier_corrupt_blocks_total", "disk") == 1
    finally:
        second_server.stop()
    rewritten = DiskTier(disk, 1 << 30).path_of(prompt_keys(llama_dir, PROMPTS[1])[5]).read_bytes()
    assert rewritten != damaged  # removed, then written again from the recomputed KV


def test_replicas_share_blocks_through_redis_and_drop_a_corrupt_value(
    llama_dir: Path, tmp_path: Path, redis_server: RedisProcess, reference_texts: list[str]
) -> None:
    url = redis_server.url
    replica_a = start_server(llama_dir, tmp_path, "--kv-disk-dir", str(tmp_path / "a"), "--kv-redis-url", url)
    try:
        assert [complete(replica_a, p) for p in PROMPTS] == [Completion(text, 0) for text in reference_texts]
        wait_for_metric(replica_a, "kvyard_kv_tier_written_blocks_total", "redis", 2 * FULL_PREFIX // BLOCK_SIZE)
    finally:
        replica_a.stop()
    redis_server.client().setrange(RedisTier.redis_key(prompt_keys(llama_dir, PROMPTS[1])[3]), 200, b"\x00\x01\x02")

    replica_b = start_server(llama_dir, tmp_path, "--kv-disk-dir", str(tmp_path / "b"), "--kv-redis-url", url)
    try:
        assert complete(replica_b, PROMPTS[0]) == Completion(reference_texts[0], FULL_PREFIX)
        assert tier_metric(replica_b, "kvyard_kv_tier_hits_total", "redis") == FULL_PREFIX // BLOCK_SIZE
        assert tier_metric(replica_b, "kvyard_kv_tier_hits_total", "disk") == 0
        assert complete(replica_b, PROMPTS[1]) == Completion(reference_texts[1], 3 * BLOCK_SIZE)
        assert tier_metric(replica_b, "kvyard_kv_tier_corrupt_blocks_total", "redis") == 1
    finally:
        replica_b.stop()


def test_requests_succeed_when_redis_dies_mid_run(llama_dir: Path, tmp_path: Path, redis_server: RedisProcess) -> None:
    server = start_server(llama_dir, tmp_path, "--kv-tier", "redis", "--kv-redis-url", redis_server.url)
    prompts = [make_prompt(seed, 120) for seed in range(1, 13)]
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(complete, server, prompt) for prompt in prompts]
            futures[0].result()
            redis_server.kill()
            results = [future.result() for future in futures]  # each asserts HTTP 200
        assert all(len(r.text) > 0 for r in results)
        again = [complete(server, make_prompt(seed, 120)) for seed in range(20, 23)]
        assert all(len(r.text) > 0 for r in again)
        assert tier_metric(server, "kvyard_kv_tier_errors_total", "redis") >= 1
    finally:
        server.stop()
    assert "kv redis tier" in server.log()


def test_other_model_dtype_block_size_or_salt_never_reads_the_blocks(
    llama_dir: Path, tmp_path: Path, redis_server: RedisProcess
) -> None:
    tier = KVTierConfig(tiers=("disk", "redis"), disk_dir=str(tmp_path / "kv"), redis_url=redis_server.url)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLM(str(llama_dir), kv_tier=tier, served_model_name="m") as writer:
        writer.generate([PROMPT], params)
    twin = create_model("llama", "tiny", tmp_path / "twin", seed=1)  # same shapes and name, other weights
    variants: list[tuple[Path, dict[str, object]]] = [
        (twin, {}),
        (llama_dir, {"dtype": "bfloat16"}),
        (llama_dir, {"block_size": 8}),
        (llama_dir, {"cache_salt": "tenant-b"}),
    ]
    for model, options in variants:
        salt = options.pop("cache_salt", None)
        with LLM(str(model), served_model_name="m", **options) as plain:
            expected = plain.generate([PROMPT], params)[0]
        with LLM(str(model), kv_tier=tier, served_model_name="m", **options) as reader:
            got = reader.generate([PROMPT], params, cache_salt=salt)[0]  # type: ignore[arg-type]
            snapshot = reader.engine.kv_tier_snapshot()
        assert got.num_cached_tokens == 0, (model, options, salt)
        assert got.token_ids == expected.token_ids
        assert snapshot is not None and snapshot.loaded_blocks == 0
    with LLM(str(llama_dir), kv_tier=tier, served_model_name="m") as same:
        assert same.generate([PROMPT], params)[0].num_cached_tokens > 0  # the control: same namespace hits


def test_nothing_arrives_before_the_deadline_so_everything_is_recomputed(llama_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tier = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"))
    with LLM(str(llama_dir), kv_tier=tier) as writer:
        expected = writer.generate([PROMPT], params)[0]
    hurried = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"), load_deadline_s=1e-9)
    with LLM(str(llama_dir), kv_tier=hurried) as reader:
        got = reader.generate([PROMPT], params)[0]
        stats = reader.engine.stats()
    # A deadline past before the first block arrives is not extended: the extension is earned block by block.
    assert (got.num_cached_tokens, got.token_ids) == (0, expected.token_ids)
    assert stats.prefill_s_per_token is not None  # each block would push the deadline back half its compute time
    extension = stats.prefill_s_per_token * BLOCK_SIZE / hurried.load_min_speedup
    assert stats.tier_load_extension_s_per_block == pytest.approx(extension)


def test_a_stalled_redis_is_a_miss_not_an_error(llama_dir: Path, tmp_path: Path) -> None:
    stalled = start_redis(tmp_path, extra=("--enable-debug-command", "yes"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tier = KVTierConfig(tiers=("redis",), redis_url=stalled.url, redis_timeout_s=0.5)
    try:
        with LLM(str(llama_dir), kv_tier=tier) as writer:
            expected = writer.generate([PROMPT], params)[0]
        sleeper = threading.Thread(target=lambda: stalled.client().execute_command("DEBUG", "SLEEP", "3"))
        sleeper.start()
        probe = redis.Redis(host="127.0.0.1", port=stalled.port, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the server is seen to stall
            try:
                probe.ping()
            except redis.TimeoutError:
                break
        else:
            pytest.fail("redis-server never stalled")
        with LLM(str(llama_dir), kv_tier=tier) as reader:
            got = reader.generate([PROMPT], params)[0]
            snapshot = reader.engine.kv_tier_snapshot()
        sleeper.join()
    finally:
        stalled.kill()
    assert (got.num_cached_tokens, got.token_ids) == (0, expected.token_ids)
    assert snapshot is not None and snapshot.tiers["redis"].errors >= 1


def test_generate_command_reuses_the_disk_tier_across_runs(llama_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": PROMPT, "max_tokens": 4, "ignore_eos": True}) + "\n")
    tier_flags = ["--kv-tier", "memory,disk", "--kv-disk-dir", str(tmp_path / "kv")]
    rows = []
    for run in range(2):
        results = tmp_path / f"results{run}.jsonl"
        assert (
            cli_main(["generate", str(llama_dir), "--input", str(prompts), "--output", str(results), *tier_flags]) == 0
        )
        rows.append(json.loads(results.read_text()))
    assert (rows[0]["num_cached_tokens"], rows[1]["num_cached_tokens"]) == (0, FULL_PREFIX)
    assert rows[0]["token_ids"] == rows[1]["token_ids"]
    assert cli_main(["generate", str(llama_dir), "--input", str(prompts), "--kv-tier", "redis"]) == 2  # no URL


def test_a_full_write_queue_drops_blocks_instead_of_blocking(llama_dir: Path, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tier = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path / "kv"), queue_bytes=1)
    with LLM(str(llama_dir), kv_tier=tier) as llm:
        output = llm.generate([PROMPT], params)[0]
        snapshot = llm.engine.kv_tier_snapshot()
    assert snapshot is not None
    assert snapshot.queue_dropped_blocks == snapshot.submitted_blocks >= FULL_PREFIX // BLOCK_SIZE
    assert snapshot.tiers["disk"].blocks_written == 0
    with LLM(str(llama_dir)) as plain:
        assert output.token_ids == plain.generate([PROMPT], params)[0].token_ids


def route_turn(router: ServerProcess, prompt: list[int], session: str = "chat-1") -> tuple[str, dict[str, int], str]:
    """One turn through the router: the replica that served it, its cached tokens by source, and its text."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{router.url}/v1/completions", json=body, headers={"x-session-id": session}, timeout=60)
    assert response.status_code == 200, response.text
    answer = response.json()
    by_source = answer["usage"]["prompt_tokens_details"]["cached_tokens_by_source"]
    return response.headers["x-kvyard-replica"], by_source, answer["choices"][0]["text"]


def router_has_events_of(router: ServerProcess, replica_url: str) -> None:
    from router_utils import replica_state, wait_for

    last_seq = httpx.get(
        f"{replica_url}/kv/events", params={"stream": "false", "since": 0}, headers=ADMIN, timeout=10
    ).json()["last_seq"]
    wait_for(lambda: replica_state(router, replica_url)["index_seq"] >= last_seq, 30, "router has the events")


def router_errors(router: ServerProcess) -> dict[str, float]:
    from router_utils import labelled_metric

    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    return {
        source: labelled_metric(metrics, "kvyard_router_cached_tokens_abs_error_total", source=source)
        for source in ("device", "local", "shared")
    }


def test_a_drained_session_continues_on_the_other_replica_from_redis_as_the_router_predicted(
    llama_dir: Path, tmp_path: Path, redis_server: RedisProcess
) -> None:
    """docs/contracts.md §7, with real replicas: the router follows what each one wrote to the shared store."""
    from router_utils import admin, labelled_metric, start_router

    replicas = [
        start_server(llama_dir, tmp_path, "--kv-disk-dir", str(tmp_path / name), "--kv-redis-url", redis_server.url)
        for name in "ab"
    ]
    router = start_router(tmp_path, [replica.url for replica in replicas], "--policy", "cache_aware")
    try:
        home, _, _ = route_turn(router, PROMPT)
        home_server = next(replica for replica in replicas if replica.url == home)
        wait_for_metric(home_server, "kvyard_kv_tier_written_blocks_total", "redis", FULL_PREFIX // BLOCK_SIZE)
        router_has_events_of(router, home)

        admin(router, "POST", "/admin/replicas/drain", json={"url": home}).raise_for_status()
        next_turn = [*PROMPT, *make_prompt(7, 40)]
        served, by_source, text = route_turn(router, next_turn)
        assert served != home and by_source == {"device": 0, "local": 0, "shared": FULL_PREFIX}
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        assert text == LLM(str(llama_dir)).generate([next_turn], params)[0].text

        errors = router_errors(router)
        assert all(error <= BLOCK_SIZE for error in errors.values()), f"the router missed by {errors} tokens"
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        predicted = labelled_metric(metrics, "kvyard_router_predicted_cached_tokens_by_source_total", source="shared")
        assert predicted == FULL_PREFIX
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()


def test_the_router_forgets_a_flushed_redis_and_counts_on_nothing_from_a_stalled_one(
    llama_dir: Path, tmp_path: Path
) -> None:
    from router_utils import admin, replica_state, start_router, wait_for

    stallable = start_redis(tmp_path, extra=("--enable-debug-command", "yes"))
    replicas = [
        start_server(
            llama_dir, tmp_path, "--kv-tier", "redis", "--kv-redis-url", stallable.url, "--kv-redis-timeout-s", "0.5"
        )
        for _ in range(2)
    ]
    router = start_router(tmp_path, [replica.url for replica in replicas], "--policy", "cache_aware")
    try:
        home, _, _ = route_turn(router, PROMPT)
        other = next(replica.url for replica in replicas if replica.url != home)
        home_server = next(replica for replica in replicas if replica.url == home)
        wait_for_metric(home_server, "kvyard_kv_tier_written_blocks_total", "redis", FULL_PREFIX // BLOCK_SIZE)
        router_has_events_of(router, home)
        store_before = replica_state(router, home)["shared_store"]
        assert store_before is not None

        stallable.client().flushall()  # idle writers see the store's new id within a second
        for url in (home, other):
            wait_for(
                lambda url=url: replica_state(router, url)["shared_store"] not in (None, store_before),
                30,
                "the router sees the flushed store's new id",
            )
        admin(router, "POST", "/admin/replicas/drain", json={"url": home}).raise_for_status()
        next_turn = [*PROMPT, *make_prompt(7, 40)]
        served, cached, _ = route_turn(router, next_turn)
        assert served == other and cached == {"device": 0, "local": 0, "shared": 0}
        assert router_errors(router)["shared"] == 0

        other_server = next(replica for replica in replicas if replica.url == other)
        wait_for_metric(
            other_server, "kvyard_kv_tier_written_blocks_total", "redis", (len(next_turn) - 1) // BLOCK_SIZE
        )
        router_has_events_of(router, other)
        admin(router, "POST", "/admin/replicas", json={"url": home}).raise_for_status()  # back from draining
        admin(router, "POST", "/admin/replicas/drain", json={"url": other}).raise_for_status()
        staller = threading.Thread(target=lambda: stallable.client().execute_command("DEBUG", "SLEEP", "4"))
        staller.start()
        try:
            wait_for(
                lambda: not replica_state(router, home)["load"]["shared_tier_available"],
                10,
                "the replica reports its store unavailable",
            )
            started = time.monotonic()
            served, cached, _ = route_turn(router, next_turn)  # its last blocks are only in the stalled store
            assert served == home and time.monotonic() - started < 3, "the request waited for the stalled store"
            assert cached == {"device": FULL_PREFIX, "local": 0, "shared": 0}
            assert router_errors(router)["shared"] == 0
        finally:
            staller.join()
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
        stallable.kill()

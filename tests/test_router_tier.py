"""The router sees the KV tier (docs/contracts.md §7): simulated replicas with a host tier each and one shared
store publish what their tiers hold; the router predicts cached tokens by source, and the replicas' usage agrees
per request."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from kvyard.router.config import RouterConfig
from kvyard.router.keys import PromptKeys
from kvyard.router.policies import CacheAware, RouteRequest
from kvyard.router.replica import Replica
from kvyard.router.tier_index import SharedStoreIndex
from kvyard.sim.config import SimConfig
from kvyard.sim.engine import SimEngine
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY, SimCluster, sim_server_options
from tests.router_utils import admin, labelled_metric, replica_state, start_router, wait_for
from tests.server_utils import ServerProcess

MODEL = "sim-model"
BLOCK_SIZE = 4
PROMPT_TOKENS = 41  # ten full blocks; the last token is always computed
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
# Device caches of 16 blocks: two other prompts evict a prompt's every block from one.
TIERED = SimConfig(
    model_name=MODEL,
    block_size=BLOCK_SIZE,
    num_kv_blocks=16,
    time_scale=0.01,
    kv_bytes_per_token=1000,
    host_tier_blocks=256,
    shared_store_blocks=256,
)


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 997 for i in range(length)]


def complete(router: ServerProcess, tokens: list[int], session: str) -> tuple[str, dict[str, int]]:
    response = httpx.post(
        f"{router.url}/v1/completions",
        headers={"x-session-id": session},
        timeout=60,
        json={"model": MODEL, "prompt": tokens, "max_tokens": 2, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    details: dict[str, Any] = response.json()["usage"]["prompt_tokens_details"]
    assert sum(details["cached_tokens_by_source"].values()) == details["cached_tokens"]
    return response.headers["x-kvyard-replica"], details["cached_tokens_by_source"]


def router_metric(router: ServerProcess, name: str, **labels: str) -> float:
    return labelled_metric(httpx.get(f"{router.url}/metrics", timeout=10).text, name, **labels)


def settle(router: ServerProcess, replicas: list[SimEngine], urls: list[str]) -> None:
    """Wait until every replica's tier writes are done and the router has their events."""
    for replica in replicas:
        assert replica.tier is None or replica.tier.store.flush(timeout=10)
    for url, replica in zip(urls, replicas):
        log = replica.core.kv_event_log()
        assert log is not None
        last = log.last_seq
        wait_for(
            lambda url=url, last=last: replica_state(router, url)["index_seq"] >= last,
            10,
            f"router has the events of {url}",
        )


def test_the_router_predicts_host_tier_and_shared_store_hits_and_a_drained_session_loads_its_history(
    tmp_path: Path,
) -> None:
    with SimCluster([TIERED, TIERED]) as sim:
        router = start_router(tmp_path, sim.urls, "--policy", "cache_aware")
        try:
            home, first = complete(router, prompt(1), "conversation")
            assert first == {"device": 0, "local": 0, "shared": 0}
            other = next(url for url in sim.urls if url != home)
            for seed in (2, 3):  # two other conversations push it out of its replica's device cache
                complete(router, prompt(seed), f"pusher-{seed}")
            settle(router, sim.replicas, sim.urls)
            state = replica_state(router, home)
            assert state["local_tier_blocks"] >= CACHEABLE // BLOCK_SIZE and state["shared_store"] is not None

            served, again = complete(router, prompt(1), "conversation")
            assert served == home and again["local"] > 0 and again["shared"] == 0

            admin(router, "POST", "/admin/replicas/drain", json={"url": home}).raise_for_status()
            settle(router, sim.replicas, sim.urls)
            served, moved = complete(router, [*prompt(1), *prompt(9, 8)], "conversation")
            assert served == other and moved["shared"] == CACHEABLE

            for source in ("device", "local", "shared"):
                predicted = router_metric(
                    router, "kvyard_router_predicted_cached_tokens_by_source_total", source=source
                )
                reported = router_metric(router, "kvyard_router_reported_cached_tokens_by_source_total", source=source)
                error = router_metric(router, "kvyard_router_cached_tokens_abs_error_total", source=source)
                assert (predicted, error) == (reported, 0), source
            assert router_metric(router, "kvyard_router_reported_cached_tokens_by_source_total", source="shared") > 0
        finally:
            router.stop()


def test_a_replica_restart_resyncs_its_local_tier_but_the_shared_store_stays_known(tmp_path: Path) -> None:
    config = replace(TIERED, num_kv_blocks=64)
    with SimCluster([config]) as sim:
        router = start_router(tmp_path, sim.urls, "--policy", "cache_aware")
        try:
            url = sim.urls[0]
            complete(router, prompt(1), "conversation")
            settle(router, sim.replicas, sim.urls)
            assert replica_state(router, url)["local_tier_blocks"] > 0
            httpx.post(f"{url}/sim/restart", headers={"authorization": f"Bearer {TEST_ADMIN_KEY}"}, timeout=10)
            wait_for(lambda: replica_state(router, url)["local_tier_blocks"] == 0, 10, "local tier index emptied")
            _, after = complete(router, prompt(1), "conversation")
            assert after == {"device": 0, "local": 0, "shared": CACHEABLE}
            assert router_metric(router, "kvyard_router_cached_tokens_abs_error_total") == 0
        finally:
            router.stop()


def test_replicas_that_split_their_cache_by_caller_key_are_indexed_under_the_routers_salt(tmp_path: Path) -> None:
    """Replicas with --cache-salt-per-api-key salt every block with their caller's key, the router's: the router
    keys prompts the same way, so the blocks a replica announces are the ones it predicts."""
    router_key = "router-upstream-key"
    options = sim_server_options(api_keys=[router_key], cache_salt_per_api_key=True)
    config = replace(TIERED, host_tier_blocks=0, shared_store_blocks=0, num_kv_blocks=256)
    with SimCluster([config, config], options) as sim:
        router = start_router(tmp_path, sim.urls, "--policy", "cache_aware", "--replica-api-key", router_key)
        try:
            holder = sim.urls[1]  # filled directly, as another router with the same key would: only events tell
            direct = httpx.post(
                f"{holder}/v1/completions",
                headers={"authorization": f"Bearer {router_key}"},
                json={"model": MODEL, "prompt": prompt(4), "max_tokens": 1},
                timeout=60,
            )
            assert direct.status_code == 200, direct.text
            settle(router, sim.replicas, sim.urls)
            served, cached = complete(router, prompt(4), "conversation")
            assert (served, cached) == (holder, {"device": CACHEABLE, "local": 0, "shared": 0})
            assert router_metric(router, "kvyard_router_cached_tokens_abs_error_total") == 0
        finally:
            router.stop()


def test_a_full_shared_store_index_forgets_its_oldest_keys_and_keeps_the_newest() -> None:
    index = SharedStoreIndex(max_keys=64)
    keys = [i.to_bytes(8, "big") for i in range(1000)]
    for start in range(0, len(keys), 10):
        index.stored(keys[start : start + 10], now=0.0)
        index.stored(keys[:1], now=0.0)  # stored again: the newest, never forgotten
    kept = len(index)
    assert 48 <= kept <= 64
    assert all(index.holds(key, 0.0) for key in [keys[0], *keys[-(kept - 1) :]])
    assert not any(index.holds(key, 0.0) for key in keys[1 : -(kept - 1)])


def test_keys_a_request_reads_are_the_last_a_full_shared_store_index_forgets() -> None:
    index = SharedStoreIndex(max_keys=64)
    history = [i.to_bytes(8, "big") for i in range(8)]  # a conversation's first blocks, written once
    index.stored(history, now=0.0)
    others = [i.to_bytes(8, "big") for i in range(100, 1100)]
    for start in range(0, len(others), 10):
        index.stored(others[start : start + 10], now=0.0)
        index.used([*history[:4], b"not held", *history[4:]])  # each turn reads its history; a miss ends it
    assert all(index.holds(key, 0.0) for key in history[:4])
    assert not any(index.holds(key, 0.0) for key in history[4:])  # past the miss: never read, so forgotten


def test_the_router_marks_the_chosen_replicas_shared_blocks_as_read() -> None:
    policy = CacheAware(RouterConfig())
    stores = policy.shared_stores
    stores.max_keys = 4
    a = Replica("http://a")
    a.shared_store_id = "store-1"
    index = stores.joined("store-1", None)
    tokens = list(range(64))
    request = RouteRequest("completion", {"model": "m"}, None, tokens, None)
    root, block_size = policy._root(request, a)
    keys = PromptKeys.of(root, block_size, tokens).all()
    index.stored(keys[:2], now=0.0)
    index.stored([b"x", b"y"], now=0.0)
    policy.choose(request, [a])  # reads keys[:2]: now newer than x and y
    index.stored([b"z"], now=0.0)  # over the cap: the least recently used go
    assert index.holds(keys[0], 0.0) and index.holds(keys[1], 0.0) and not index.holds(b"x", 0.0)

"""The KV tier of simulated replicas: a host-memory tier per replica and a store shared by the replicas of one
process, fed and read by the engine's own tier code with stand-in blocks, each load charged its modeled time."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.sim.config import SimConfig
from kvyard.sim.engine import SimEngine
from kvyard.sim.tier import TierCharge, TierTiming, model_load, shared_store
from kvyard.testing.sim_cluster import SimCluster
from tests.router_utils import labelled_metric, wait_for
from tests.server_utils import ADMIN, metric_value, model_names

BLOCK_SIZE = 4
KV_BYTES_PER_TOKEN = 1000
PROMPT_TOKENS = 41  # ten full blocks, the last token left to compute
CACHEABLE = (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
# A device cache of 16 blocks: each request takes 11 of them, so two other prompts evict a prompt's every block.
CONFIG = SimConfig(
    model_name="sim-model",
    block_size=BLOCK_SIZE,
    num_kv_blocks=16,
    time_scale=0.01,
    kv_bytes_per_token=KV_BYTES_PER_TOKEN,
)
HOST = replace(CONFIG, host_tier_blocks=256)
SHARED = replace(CONFIG, shared_store_blocks=256)


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 997 for i in range(length)]


def complete(url: str, tokens: list[int], max_tokens: int = 2) -> dict[str, Any]:
    response = httpx.post(
        f"{url}/v1/completions", timeout=60, json={"prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True}
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def cached_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric(url: str, name: str, **labels: str) -> float:
    return labelled_metric(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)


def flush(replica: SimEngine) -> None:
    """Wait for the replica's write-behind tier writes, so what it computed is in its tiers."""
    assert replica.tier is not None and replica.tier.store.flush(timeout=10)


def evict_from_device(url: str, replica: SimEngine, *seeds: int) -> None:
    for seed in seeds:
        complete(url, prompt(seed))
    flush(replica)


def cache_then_evict(url: str, replica: SimEngine) -> None:
    """Prompt 1 computed, written to the tier, then pushed out of the device cache."""
    complete(url, prompt(1))
    evict_from_device(url, replica, 2, 3)


def test_an_evicted_prompt_is_reloaded_from_the_host_tier() -> None:
    with SimCluster([HOST]) as sim:
        url, replica = sim.urls[0], sim.replicas[0]
        first = complete(url, prompt(1))
        assert cached_tokens(first) == 0
        evict_from_device(url, replica, 2, 3)
        again = complete(url, prompt(1))
        assert cached_tokens(again) == CACHEABLE
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert replica.stats().kv_tier_hit_tokens == CACHEABLE
        assert metric(url, "kvyard_sim_tier_hit_tokens_total", source="host") == CACHEABLE
        assert metric(url, "kvyard_sim_tier_hit_tokens_total", source="shared") == 0
        assert metric(url, "kvyard_sim_tier_model_bytes_total", source="host") == CACHEABLE * KV_BYTES_PER_TOKEN
        seconds = metric(url, "kvyard_sim_tier_model_seconds_total", source="host")
        assert seconds == pytest.approx(CACHEABLE * KV_BYTES_PER_TOKEN / (HOST.host_tier_gb_per_s * 1e9))
        assert metric(url, "kvyard_kv_tier_hits_total", tier="memory") == CACHEABLE // BLOCK_SIZE
        assert metric(url, "kvyard_kv_tier_written_blocks_total", tier="memory") >= 3 * CACHEABLE // BLOCK_SIZE
        models = model_names(httpx.get(f"{url}/metrics", timeout=10).text)  # tier samples name the model too
        assert {
            "kvyard_kv_tier_hits_total",
            "kvyard_kv_tier_load_seconds_count",
            "kvyard_kv_tier_queue_blocks",
            "kvyard_sim_tier_hit_tokens_total",
        } <= set(models)
        assert {name: labels for name, labels in models.items() if labels != {"sim-model"}} == {}


def test_a_tier_load_is_held_back_by_its_modeled_time() -> None:
    # 10 blocks of 4,000 modeled bytes at 200 bytes per simulated second: 200 s, two wall seconds at scale 0.01.
    slow = replace(HOST, host_tier_gb_per_s=2e-7, tier_load_deadline_s=1000.0)
    with SimCluster([slow]) as sim:
        url = sim.urls[0]
        cache_then_evict(url, sim.replicas[0])
        held: list[dict[str, Any]] = []
        thread = threading.Thread(target=lambda: held.append(complete(url, prompt(1))))
        thread.start()
        wait_for(lambda: httpx.get(f"{url}/load").json()["num_waiting"] == 1, 20, "the tier load under way")
        assert complete(url, prompt(9, BLOCK_SIZE), max_tokens=1)["usage"]["completion_tokens"] == 1
        assert not held  # the loop answered while the request was still waiting for its blocks
        thread.join(timeout=30)
        assert held and cached_tokens(held[0]) == CACHEABLE
        assert metric(url, "kvyard_sim_tier_model_seconds_total", source="host") == pytest.approx(200.0)


def test_blocks_that_would_arrive_after_the_load_deadline_are_computed() -> None:
    # 20 simulated seconds a block: 5 of the 10 arrive within 110 s.
    slow = replace(HOST, host_tier_gb_per_s=2e-7, tier_load_deadline_s=110.0)
    with SimCluster([slow]) as sim:
        url = sim.urls[0]
        cache_then_evict(url, sim.replicas[0])
        assert cached_tokens(complete(url, prompt(1))) == 5 * BLOCK_SIZE
        assert metric(url, "kvyard_sim_tier_hit_tokens_total", source="host") == 5 * BLOCK_SIZE


def test_a_load_that_outruns_computing_keeps_going_past_the_deadline() -> None:
    # A deadline that ends before the first block arrives; loading a block costs far less than computing it, so
    # each block brought pushes the deadline back by more than it took. With the extension off, all is computed.
    late = replace(HOST, tier_load_deadline_s=1e-6)
    for min_speedup, expected in ((2.0, CACHEABLE), (0.0, 0)):
        with SimCluster([replace(late, tier_load_min_speedup=min_speedup)]) as sim:
            url = sim.urls[0]
            cache_then_evict(url, sim.replicas[0])
            load = httpx.get(f"{url}/load", timeout=10).json()
            assert (load["tier_load_extension_s_per_block"] > 0) == (min_speedup > 0)
            assert cached_tokens(complete(url, prompt(1))) == expected


def test_a_replica_serves_from_the_shared_store_what_another_computed() -> None:
    with SimCluster([SHARED] * 2) as sim:
        (url_a, url_b), (replica_a, _) = sim.urls, sim.replicas
        computed = complete(url_a, prompt(5))
        assert cached_tokens(computed) == 0
        flush(replica_a)
        served = complete(url_b, prompt(5))
        assert cached_tokens(served) == CACHEABLE
        assert served["choices"][0]["text"] == computed["choices"][0]["text"]
        assert metric(url_b, "kvyard_sim_tier_hit_tokens_total", source="shared") == CACHEABLE
        assert metric(url_a, "kvyard_sim_tier_hit_tokens_total", source="shared") == 0
        bytes_seconds = CACHEABLE * KV_BYTES_PER_TOKEN / (SHARED.shared_store_gb_per_s * 1e9)
        assert metric(url_b, "kvyard_sim_tier_model_seconds_total", source="shared") == pytest.approx(
            SHARED.shared_store_latency_s + bytes_seconds
        )
        # A's lookup missed: one round trip, no bytes.
        assert metric(url_a, "kvyard_sim_tier_model_seconds_total", source="shared") == pytest.approx(
            SHARED.shared_store_latency_s
        )
        text = httpx.get(f"{url_b}/metrics", timeout=10).text
        assert metric_value(text, "kvyard_sim_shared_store_blocks") == CACHEABLE // BLOCK_SIZE  # once, not twice
        assert sim.replicas[1].shared_store is replica_a.shared_store


def test_the_shared_store_outlives_a_replica_restart_and_the_host_tier_does_not() -> None:
    both = replace(HOST, shared_store_blocks=256)
    with SimCluster([both]) as sim:
        url, replica = sim.urls[0], sim.replicas[0]
        complete(url, prompt(1))
        flush(replica)
        assert httpx.post(f"{url}/sim/restart", headers=ADMIN, timeout=10).json() == {"status": "restarted"}
        assert cached_tokens(complete(url, prompt(1))) == CACHEABLE
        assert metric(url, "kvyard_sim_tier_hit_tokens_total", source="shared") == CACHEABLE
        assert metric(url, "kvyard_sim_tier_hit_tokens_total", source="host") == 0


@pytest.mark.parametrize("capacity", ["host_tier_blocks", "shared_store_blocks"])
def test_tier_capacity_is_lru_bounded(capacity: str) -> None:
    settings: dict[str, Any] = {capacity: 12}
    small = replace(CONFIG, **settings)
    with SimCluster([small]) as sim:
        url, replica = sim.urls[0], sim.replicas[0]
        evict_from_device(url, replica, 1, 2, 3)
        assert replica.tier is not None
        store = replica.shared_store if capacity == "shared_store_blocks" else replica.tier.store.tiers[0]
        assert isinstance(store, MemoryTier) and len(store) == 12
        assert cached_tokens(complete(url, prompt(1))) == 0  # the oldest blocks went first
        assert metric(url, "kvyard_sim_tier_hit_tokens_total") == 0


def test_tiers_are_off_by_default() -> None:
    with SimCluster([CONFIG]) as sim:
        url, replica = sim.urls[0], sim.replicas[0]
        complete(url, prompt(1))
        for seed in (2, 3):
            complete(url, prompt(seed))
        assert cached_tokens(complete(url, prompt(1))) == 0
        assert replica.tier is None and replica.shared_store is None
        assert replica.stats().kv_tier_hit_tokens == 0
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert "kvyard_sim_tier_hit_tokens_total{" not in text and "kvyard_kv_tier_hits_total{" not in text


def test_model_load_charges_latency_and_bytes_and_stops_at_the_deadline() -> None:
    host, shared = TierTiming("host", 0.0, 1.0), TierTiming("shared", 0.5, 0.5)  # 1 and 2 s per 10^9-byte block
    block = 10**9
    assert model_load([(host, 2), (shared, 3)], block, 100.0) == [
        TierCharge("host", 2, 2.0),
        TierCharge("shared", 3, 6.5),
    ]
    assert model_load([(host, 2), (shared, 3)], block, 7.0) == [
        TierCharge("host", 2, 2.0),
        TierCharge("shared", 2, 5.0),
    ]
    assert model_load([(host, 0), (shared, 3)], block, 0.25) == [
        TierCharge("host", 0, 0.0),
        TierCharge("shared", 0, 0.25),
    ]
    assert model_load([(shared, 0)], block, 100.0) == [TierCharge("shared", 0, 0.5)]  # a miss costs a round trip


def test_model_load_pushes_the_deadline_back_for_each_block_that_arrives() -> None:
    host, shared = TierTiming("host", 0.0, 1.0), TierTiming("shared", 0.5, 0.5)  # 1 and 2 s per 10^9-byte block
    block = 10**9
    # 1 s of extension a block: the host's 2 blocks cost nothing net; of the shared 3, 2 arrive by 3 + 2 s.
    assert model_load([(host, 2), (shared, 3)], block, 3.0, 1.0) == [
        TierCharge("host", 2, 2.0),
        TierCharge("shared", 2, 5.0),
    ]
    # Blocks that arrive faster than the extension they earn: the whole load, however long.
    assert model_load([(shared, 1000)], block, 1.0, 3.0) == [TierCharge("shared", 1000, 2000.5)]
    assert model_load([(host, 2)], block, -1.0, 10.0) == [TierCharge("host", 0, 0.0)]  # queued past its deadline


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("host_tier_blocks", -1),
        ("shared_store_blocks", -1),
        ("host_tier_gb_per_s", 0.0),
        ("shared_store_gb_per_s", -1.0),
        ("shared_store_latency_s", -0.1),
        ("tier_load_deadline_s", 0.0),
        ("tier_load_min_speedup", -1.0),
    ],
)
def test_bad_tier_settings_are_rejected(name: str, value: float) -> None:
    settings: dict[str, Any] = {name: value}
    with pytest.raises(ValueError, match=name):
        SimConfig(**settings)


def test_replicas_of_one_process_agree_on_the_shared_store() -> None:
    assert shared_store([CONFIG]) is None
    with pytest.raises(ValueError, match="shared_store_blocks"):
        shared_store([replace(CONFIG, shared_store_blocks=4), replace(CONFIG, shared_store_blocks=8)])


def kvyard_sim(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvyard", "sim", *arguments], capture_output=True, text=True, timeout=60
    )


def test_kvyard_sim_rejects_a_negative_tier_capacity() -> None:
    result = kvyard_sim("--port", "0", "--host-tier-blocks", "-1")
    assert result.returncode != 0 and "host_tier_blocks" in result.stderr


def test_kvyard_sim_help_lists_the_tier_settings() -> None:
    result = kvyard_sim("--help")
    assert result.returncode == 0
    for flag in (
        "--host-tier-blocks",
        "--host-tier-gb-per-s",
        "--shared-store-blocks",
        "--shared-store-gb-per-s",
        "--shared-store-latency-s",
        "--tier-load-deadline-s",
    ):
        assert flag in result.stdout


def test_kvyard_sim_replicas_share_a_store_from_the_command_line(tmp_path: Any) -> None:
    ports_file = tmp_path / "ports.json"
    log = (tmp_path / "sim.log").open("wb")
    sims = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvyard",
            "sim",
            "--port",
            "0",
            "--replicas",
            "2",
            "--ports-file",
            str(ports_file),
            "--block-size",
            str(BLOCK_SIZE),
            "--time-scale",
            "0.01",
            "--shared-store-blocks",
            "64",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: ports_file.exists() or sims.poll() is not None, 60, "simulated replicas up")
        assert sims.poll() is None, (tmp_path / "sim.log").read_text()
        url_a, url_b = json.loads(ports_file.read_text())["urls"]
        complete(url_a, prompt(7))

        def written() -> bool:
            return metric(url_a, "kvyard_kv_tier_written_blocks_total", tier="shared") >= CACHEABLE // BLOCK_SIZE

        wait_for(written, 20, "A's blocks in the shared store")
        assert cached_tokens(complete(url_b, prompt(7))) == CACHEABLE
    finally:
        sims.send_signal(signal.SIGTERM)
        assert sims.wait(timeout=30) == 0
        log.close()

"""Simulated replicas in prefill/decode roles: a real `kvyard sim --prefill-replicas` behind a real `kvyard route`
moves blocks over HTTP as real replicas do, charges the modeled transfer time, and leaks no lease."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY, SimCluster, pd_roles
from tests.pd_utils import pd_request
from tests.router_utils import labelled_metric, start_router, wait_for
from tests.server_utils import ServerProcess, metric_value

BLOCK_SIZE = 4
KV_BYTES_PER_TOKEN = 1000
CONFIG = SimConfig(
    model_name="sim-model",
    block_size=BLOCK_SIZE,
    num_kv_blocks=1024,
    time_scale=0.01,
    kv_bytes_per_token=KV_BYTES_PER_TOKEN,
)


def prompt(seed: int, length: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 997 for i in range(length)]


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def pd_paths(router: ServerProcess) -> dict[str, float]:
    found = {}
    for line in metrics(router.url).splitlines():
        if line.startswith("kvyard_router_pd_requests_total{"):
            name, value = line.rsplit(" ", 1)
            found[name.split('"')[1]] = float(value)
    return found


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], ServerProcess]]:
    """`kvyard sim`: one prefill and two decode replicas; a router that disaggregates every prompt with more than
    16 tokens for its decode replica to compute."""
    logs = tmp_path_factory.mktemp("sim-pd")
    ports_file = logs / "ports.json"
    arguments = [
        "--port",
        "0",
        "--replicas",
        "3",
        "--prefill-replicas",
        "1",
        "--ports-file",
        str(ports_file),
        "--block-size",
        str(BLOCK_SIZE),
        "--time-scale",
        "0.01",
        "--kv-bytes-per-token",
        str(KV_BYTES_PER_TOKEN),
        "--admin-key",
        TEST_ADMIN_KEY,
    ]
    with (logs / "sim.log").open("wb") as log:
        sims = subprocess.Popen(
            [sys.executable, "-m", "kvyard", "sim", *arguments], stdout=log, stderr=subprocess.STDOUT
        )
    router = None
    try:
        wait_for(lambda: ports_file.exists() or sims.poll() is not None, 60, "simulated replicas up")
        assert sims.poll() is None, (logs / "sim.log").read_text()
        urls: list[str] = json.loads(ports_file.read_text())["urls"]
        router = start_router(logs, urls, "--pd-local-prefill-tokens", "16")
        yield urls, router
    finally:
        if router is not None:
            router.stop()
        sims.send_signal(signal.SIGTERM)
        assert sims.wait(timeout=30) == 0


def complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/completions", json={"max_tokens": 6, "ignore_eos": True, **body}, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_sim_roles_come_from_the_command_line(fleet: tuple[list[str], ServerProcess]) -> None:
    urls, _ = fleet
    assert [httpx.get(f"{url}/load").json()["role"] for url in urls] == ["prefill", "decode", "decode"]


def test_routed_requests_move_blocks_from_the_prefill_sim(fleet: tuple[list[str], ServerProcess]) -> None:
    urls, router = fleet
    prefill, decoders = urls[0], urls[1:]
    before = sum(metric_value(metrics(url), "kvyard_kv_transfer_pulled_blocks_total") for url in decoders)
    remote_before = pd_paths(router).get("remote", 0)
    answers = [complete(router.url, {"prompt": prompt(seed, 101)}) for seed in range(3)]
    streamed = httpx.post(
        f"{router.url}/v1/completions",
        timeout=60,
        json={"prompt": prompt(9, 101), "max_tokens": 6, "ignore_eos": True, "stream": True},
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert pd_paths(router).get("remote", 0) - remote_before == 4
    pulled = sum(metric_value(metrics(url), "kvyard_kv_transfer_pulled_blocks_total") for url in decoders)
    assert pulled - before == 4 * (101 - 1) // BLOCK_SIZE  # every full block but the one with the last token
    for seed, answer in enumerate(answers):  # the decode replica answers as a replica that prefilled it would
        assert answer["choices"][0]["text"] == complete(prefill, {"prompt": prompt(seed, 101)})["choices"][0]["text"]
    wait_for(lambda: metric_value(metrics(prefill), "kvyard_kv_transfer_leased_blocks") == 0, 20, "leases ended")
    assert metric_value(metrics(prefill), "kvyard_kv_transfer_leases_released_total") >= 4


def test_pulls_are_charged_the_modeled_bytes_of_the_blocks(fleet: tuple[list[str], ServerProcess]) -> None:
    urls, _ = fleet
    for url in urls[1:]:
        text = metrics(url)
        blocks = metric_value(text, "kvyard_kv_transfer_pulled_blocks_total")
        assert metric_value(text, "kvyard_sim_transfer_model_bytes_total") == blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN
        pulls = metric_value(text, "kvyard_kv_transfer_pulls_total")
        seconds = metric_value(text, "kvyard_sim_transfer_model_seconds_total")
        bytes_seconds = blocks * CONFIG.kv_bytes_per_block / (CONFIG.transfer_gb_per_s * 1e9)
        assert seconds == pytest.approx(pulls * CONFIG.transfer_latency_s + bytes_seconds)


def test_a_burst_of_disaggregated_requests_spreads_over_the_prefill_pool(tmp_path: Path) -> None:
    """Prefill legs decided in one burst see each other's queued work, as unified requests do: otherwise every
    request of the burst scores the replica that holds a hot prefix as idle and queues behind the others there."""
    with SimCluster([CONFIG] * 4, roles=pd_roles(4, 3)) as sim:
        router = start_router(tmp_path, sim.urls, "--disaggregation", "always")
        try:
            hot = prompt(7, 320)
            complete(router.url, {"prompt": [*hot, 1]})  # one prefill replica now holds the hot prefix
            # Each request still has 96 tokens of its own: together far more than the hot prefix once more.
            burst = [{"prompt": hot + prompt(100 + i, 96), "max_tokens": 2} for i in range(24)]

            async def send_all() -> list[httpx.Response]:
                async with httpx.AsyncClient(timeout=120) as client:
                    return await asyncio.gather(
                        *(
                            client.post(f"{router.url}/v1/completions", json={"ignore_eos": True, **body})
                            for body in burst
                        )
                    )

            assert all(response.status_code == 200 for response in asyncio.run(send_all()))
            legs = [labelled_metric(metrics(url), "kvyard_requests_total") for url in sim.urls[:3]]
            # Decided blind to each other, 20-25 of the 25 went to the hot replica; seen, 11, 7 and 7.
            assert sum(legs) == 25 and max(legs) <= 15 and min(legs) >= 4, f"prefill legs per prefill replica: {legs}"
        finally:
            router.stop()


def test_a_decode_sim_serves_others_while_a_pull_is_held_back() -> None:
    slow_link = replace(CONFIG, transfer_latency_s=200.0)  # 2 wall seconds per pull at time scale 0.01
    with SimCluster([slow_link] * 2, roles=pd_roles(2, 1)) as sim:
        prefill, decode = sim.urls
        held: list[Any] = []
        thread = threading.Thread(
            target=lambda: held.append(
                pd_request(prefill, decode, {"prompt": prompt(1, 41), "max_tokens": 2, "ignore_eos": True})
            )
        )
        thread.start()
        wait_for(lambda: httpx.get(f"{decode}/load").json()["num_waiting"] == 1, 20, "the pull under way")
        assert complete(decode, {"prompt": prompt(2, 9), "max_tokens": 1})["usage"]["completion_tokens"] == 1
        assert not held  # the loop answered while the PD request was still waiting for its blocks
        thread.join(timeout=30)
        assert held and held[0].json()["usage"]["completion_tokens"] == 2
        assert metric_value(metrics(decode), "kvyard_kv_transfer_pulled_blocks_total") == (41 - 1) // BLOCK_SIZE


def test_transfer_seconds_is_latency_plus_bytes_over_bandwidth() -> None:
    config = SimConfig(block_size=16, kv_bytes_per_token=16384, transfer_gb_per_s=1.25, transfer_latency_s=0.001)
    assert config.transfer_seconds(0) == 0.001
    assert config.transfer_seconds(1000) == pytest.approx(0.001 + 1000 * 16 * 16384 / 1.25e9)
    with pytest.raises(ValueError, match="transfer_gb_per_s"):
        SimConfig(transfer_gb_per_s=0)


def test_a_streamed_transfer_leaves_the_last_chunk_or_what_the_link_could_not_move() -> None:
    config = SimConfig(block_size=16, kv_bytes_per_token=16384, transfer_gb_per_s=1.25, transfer_latency_s=0.001)
    chunk_blocks = config.scheduler.max_num_batched_tokens // 16
    assert config.streamed_transfer_seconds(10, 5.0) == config.transfer_seconds(10)  # all of it one chunk
    assert config.streamed_transfer_seconds(1000, 100.0) == config.transfer_seconds(chunk_blocks)  # link kept up
    whole = config.transfer_seconds(1000)
    assert config.streamed_transfer_seconds(1000, 0.0) == whole  # opened as the prefill ended: nothing overlapped
    assert config.streamed_transfer_seconds(1000, 0.1) == pytest.approx(whole - 0.1)  # the link fell behind


def test_a_pull_waits_for_the_prefill_replicas_longest_step() -> None:
    scheduler = SchedulerConfig(max_num_batched_tokens=2048, prefill_only_step_tokens=8192)
    config = SimConfig(block_size=16, scheduler=scheduler)
    # After the prefill ends the last chunk is left to move: up to 8,192 tokens (512 blocks) when nothing streamed.
    assert config.streamed_transfer_seconds(2000, 100.0) == config.transfer_seconds(8192 // 16)
    assert SimConfig(block_size=16).prefill_chunk_tokens == 2048


def test_kvyard_sim_gives_its_replicas_the_step_budgets_and_prefill_order(tmp_path: Path) -> None:
    ports_file = tmp_path / "ports.json"
    arguments = [
        "--port",
        "0",
        "--replicas",
        "2",
        "--prefill-replicas",
        "1",
        "--ports-file",
        str(ports_file),
        "--max-num-batched-tokens",
        "512",
        "--prefill-only-step-tokens",
        "4096",
        "--prefill-order",
        "shortest",
    ]
    with (tmp_path / "sim.log").open("wb") as log:
        sims = subprocess.Popen(
            [sys.executable, "-m", "kvyard", "sim", *arguments], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: ports_file.exists() or sims.poll() is not None, 60, "simulated replicas up")
        assert sims.poll() is None, (tmp_path / "sim.log").read_text()
        urls = json.loads(ports_file.read_text())["urls"]
        infos = [httpx.get(f"{url}/get_server_info", timeout=10).json() for url in urls]
        assert [
            (i["role"], i["chunked_prefill_size"], i["prefill_only_step_tokens"], i["prefill_order"]) for i in infos
        ] == [("prefill", 512, 4096, "shortest"), ("decode", 512, 4096, "shortest")]
    finally:
        sims.send_signal(signal.SIGTERM)
        assert sims.wait(timeout=30) == 0


def test_kvyard_sim_rejects_more_prefill_replicas_than_replicas() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "sim", "--port", "0", "--replicas", "2", "--prefill-replicas", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "prefill replicas" in result.stderr


def test_pd_roles() -> None:
    assert pd_roles(3, 0) == ["unified"] * 3
    assert pd_roles(4, 1) == ["prefill", "decode", "decode", "decode"]


def test_pulled_blocks_of_waiting_requests_never_stall_the_decode_replica() -> None:
    """More PD requests than the decode replica's pool holds: blocks that finished pulls wrote must not stay pinned by
    requests still waiting, or a preempted request at the head of the queue can never get blocks again."""
    small = replace(CONFIG, num_kv_blocks=48)
    with SimCluster([CONFIG, small], roles=pd_roles(2, 1)) as sim:
        prefill, decode = sim.urls
        answers: list[Any] = []

        def send(seed: int) -> None:
            answers.append(
                pd_request(
                    prefill, decode, {"prompt": prompt(seed, 41), "max_tokens": 60, "ignore_eos": True}, timeout=60
                )
            )

        threads = [threading.Thread(target=send, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
        assert len(answers) == 8 and all(a.json()["usage"]["completion_tokens"] == 60 for a in answers)
        assert metric_value(metrics(decode), "kvyard_kv_transfer_pulled_blocks_total") > 0
        assert metric_value(metrics(decode), "kvyard_num_preemptions_total") > 0  # the pool really ran out
        wait_for(lambda: httpx.get(f"{decode}/load").json()["kv_blocks_used"] == 0, 20, "every block unpinned")

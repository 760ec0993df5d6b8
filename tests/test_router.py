"""`kvyard route` in front of simulated replicas (real HTTP on loopback): policies, cache index, errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY, SimCluster
from tests.router_utils import admin, labelled_metric, replica_state, replicas_of, start_router, wait_for
from tests.server_utils import ADMIN, ServerProcess

MODEL = "sim-model"
CONFIG = SimConfig(model_name=MODEL, block_size=16, num_kv_blocks=4096, time_scale=0.05)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    with SimCluster([CONFIG] * 3) as sim:
        yield sim


@pytest.fixture()
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(length)]


def complete(router: ServerProcess, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{router.url}/v1/completions", json={"model": MODEL, "max_tokens": 4, **body}, headers=headers, timeout=60
    )


async def complete_many(router: ServerProcess, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(
            *(client.post(f"{router.url}/v1/completions", json={"model": MODEL, **body}) for body in bodies)
        )


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-kvyard-replica"]


def cached_tokens(response: httpx.Response) -> int:
    cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


# ---------------------------------------------------------------------------- errors


def test_bad_input_gets_openai_errors(cluster: SimCluster, log_dir: Path) -> None:
    router = start_router(log_dir, cluster.urls[:1])
    try:
        cases: list[tuple[str, Any, int, str | None]] = [
            ("/v1/completions", b"{not json", 400, "body"),
            ("/v1/completions", [1, 2], 400, "body"),
            ("/v1/completions", {"model": MODEL}, 400, "prompt"),
            ("/v1/completions", {"model": 5, "prompt": "x"}, 400, "model"),
            ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "stream": "yes"}, 400, "stream"),
            ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
            ("/v1/completions", {"model": "no-such-model", "prompt": [1, 2]}, 404, "model"),
            ("/admin/replicas", {}, 400, "url"),
            ("/admin/replicas", {"url": "ftp://x"}, 400, "url"),
            ("/admin/replicas/drain", {"url": "http://127.0.0.1:1"}, 404, "url"),
        ]
        for path, body, status, param in cases:
            content = body if isinstance(body, bytes) else None
            response = httpx.post(
                f"{router.url}{path}", content=content, json=None if content else body, timeout=10, headers=ADMIN
            )
            assert response.status_code == status, (path, body, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"] and error["type"]
        # The replica's own validation errors pass through unchanged, and the router stays up.
        response = complete(router, {"prompt": [1, 2], "max_tokens": -1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        for hostile in ([[{}]], [-990, 3], [2**32], [[1, 2.5]], [[1], ["x"]]):  # the replica names the field
            response = complete(router, {"prompt": hostile})
            assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", hostile
        assert complete(router, {"prompt": [1, 2, 3]}).status_code == 200
    finally:
        router.stop()


def test_head_requests_and_the_model_list_through_the_router(cluster: SimCluster, log_dir: Path) -> None:
    router = start_router(log_dir, cluster.urls[:2])
    try:
        wait_for(lambda: httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"], 20, "models")
        with httpx.Client(timeout=10) as client:  # one keep-alive connection: a body after HEAD would desync it
            for path in ("/health", "/metrics", "/v1/models", "/health"):
                head = client.head(f"{router.url}{path}")
                assert head.status_code == 200 and head.content == b"", path
                assert int(head.headers["content-length"]) > 0
            assert client.head(f"{router.url}/v1/completions").status_code == 405
            models = client.get(f"{router.url}/v1/models").json()["data"]
            replica_card = client.get(f"{cluster.urls[0]}/v1/models").json()["data"][0]
        assert [card["id"] for card in models] == [MODEL]
        assert models[0]["max_model_len"] == replica_card["max_model_len"] > 0
        assert 0 < models[0]["created"] <= replica_card["created"] + 60
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "store": False, "metadata": {"a": "b"}}
        whole = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert whole.status_code == 200 and whole.headers["x-kvyard-ignored-fields"] == "metadata, store"
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=30) as stream:
            assert stream.headers["x-kvyard-ignored-fields"] == "metadata, store"
            assert stream.headers["cache-control"] == "no-cache"  # no proxy between holds a stream back
            assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
        tokens = httpx.post(f"{router.url}/tokenize", json={"model": MODEL, "prompt": "hé"}, timeout=10)
        assert tokens.json() == httpx.post(f"{cluster.urls[0]}/tokenize", json={"prompt": "hé"}).json()
        text = httpx.post(f"{router.url}/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=10)
        assert text.json() == {"prompt": "hé"}
        refused = httpx.post(f"{router.url}/tokenize", json={"prompt": "a", "model": "other"}, timeout=10)
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
        assert httpx.get(f"{router.url}/version", timeout=10).json()["version"]
        assert "/tokenize" in httpx.get(f"{router.url}/openapi.json", timeout=10).json()["paths"]
        for url in (router.url, cluster.urls[0]):  # GET /v1/models/{id}, from the router and from a replica
            assert openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.retrieve(MODEL).id == MODEL
            missing = httpx.get(f"{url}/v1/models/no%2Fsuch-model", timeout=10)
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
            assert "no/such-model" in missing.json()["error"]["message"]
    finally:
        router.stop()


def test_the_routers_load_is_its_fleets_and_the_bench_finds_what_it_needs(cluster: SimCluster, log_dir: Path) -> None:
    """GET /load of a router sums its replicas' reports, so `kvyard bench` through a router lacks nothing a replica
    has (and a router in front of routers reads this one as a replica)."""
    router = start_router(log_dir, cluster.urls[:2])
    try:
        replicas = [httpx.get(f"{url}/load", timeout=10).json() for url in cluster.urls[:2]]
        total = sum(replica["kv_blocks_total"] for replica in replicas)
        wait_for(lambda: httpx.get(f"{router.url}/load", timeout=10).json()["kv_blocks_total"] == total, 20, "loads")
        fleet = httpx.get(f"{router.url}/load", timeout=10).json()
        out = log_dir / "through-router.json"
        command = [
            sys.executable,
            "-m",
            "kvyard",
            "bench",
            "--base-url",
            router.url,
            "--model",
            MODEL,
            "--workload",
            "random",
            "--num-requests",
            "4",
            "--input-len",
            "32",
            "--output-len",
            "4",
            "--no-progress",
            "--out",
            str(out),
        ]
        bench = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        router.stop()
    assert fleet["kv_blocks_total"] == total > 0 and fleet["role"] == "unified"
    assert bench.returncode == 0, bench.stderr
    assert "lacks" not in bench.stdout
    assert json.loads(out.read_text())["server"]["missing"] == []


# ---------------------------------------------------------------------------- session affinity


def test_session_affinity_holds_while_the_replica_is_healthy(cluster: SimCluster, log_dir: Path) -> None:
    router = start_router(log_dir, cluster.urls, "--policy", "session")
    try:
        homes = {}
        for session in range(12):
            headers = {"x-session-id": f"s{session}"}
            replicas = {
                served_by(complete(router, {"prompt": prompt(session * 10 + turn, 20)}, headers)) for turn in range(3)
            }
            assert len(replicas) == 1, f"session {session} moved between {replicas}"
            homes[session] = replicas.pop()
        assert len(set(homes.values())) >= 2, "sessions should spread over replicas"
        by_user = {served_by(complete(router, {"prompt": prompt(turn, 20), "user": "alice"})) for turn in range(3)}
        assert len(by_user) == 1

        drained = homes[0]
        admin(router, "POST", "/admin/replicas/drain", json={"url": drained}).raise_for_status()
        moved = served_by(complete(router, {"prompt": prompt(1, 20)}, headers={"x-session-id": "s0"}))
        assert moved != drained
        others = [s for s, home in homes.items() if home != drained]
        for session in others:  # sessions of healthy replicas stay where they were
            assert (
                served_by(complete(router, {"prompt": prompt(2, 20)}, headers={"x-session-id": f"s{session}"}))
                == homes[session]
            )
        admin(router, "POST", "/admin/replicas", json={"url": drained}).raise_for_status()
        assert served_by(complete(router, {"prompt": prompt(3, 20)}, headers={"x-session-id": "s0"})) == drained
    finally:
        router.stop()


# ---------------------------------------------------------------------------- cache-aware routing


def test_cache_aware_sends_a_repeated_prefix_to_the_replica_holding_it(cluster: SimCluster, log_dir: Path) -> None:
    router = start_router(log_dir, cluster.urls, "--policy", "cache_aware")
    try:
        homes = {}
        for conversation in range(6):
            history = prompt(1000 + conversation, 160)
            first = complete(router, {"prompt": history})
            homes[conversation] = served_by(first)
            for turn in range(3):
                history = history + prompt(2000 + conversation * 10 + turn, 40)
                response = complete(router, {"prompt": history})
                assert served_by(response) == homes[conversation]
                assert cached_tokens(response) >= 160
        assert len(set(homes.values())) >= 2, "new conversations should spread over idle replicas"
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        predicted = labelled_metric(metrics, "kvyard_router_predicted_cached_tokens_total")
        reported = labelled_metric(metrics, "kvyard_router_reported_cached_tokens_total")
        assert reported > 0 and predicted == reported
    finally:
        router.stop()


def test_hot_prefix_under_overload_spreads_to_a_second_replica(log_dir: Path) -> None:
    config = SimConfig(model_name=MODEL, block_size=16, num_kv_blocks=4096, time_scale=0.2)
    with SimCluster([config] * 2) as sim:
        router = start_router(log_dir, sim.urls, "--policy", "cache_aware")
        try:
            hot = prompt(7, 320)
            home = served_by(complete(router, {"prompt": [*hot, 1]}))
            # Each request of the burst still has 96 tokens of its own to prefill: together far more work
            # than computing the hot prefix once more on the idle replica.
            burst = [{"prompt": hot + prompt(100 + i, 96), "max_tokens": 8} for i in range(24)]
            served = Counter(served_by(response) for response in asyncio.run(complete_many(router, burst)))
            assert len(served) == 2, f"all of the burst went to one replica: {served}"
            second = next(url for url in served if url != home)
            later = [{"prompt": hot + prompt(500 + i, 96), "max_tokens": 8} for i in range(24)]
            hits = [cached_tokens(r) for r in asyncio.run(complete_many(router, later)) if served_by(r) == second]
            assert hits and max(hits) >= 320, "the second replica should now hold the hot prefix as well"
        finally:
            router.stop()


# ---------------------------------------------------------------------------- KV events


def test_kv_event_gap_triggers_a_resync(log_dir: Path) -> None:
    config = SimConfig(model_name=MODEL, block_size=16, num_kv_blocks=64, time_scale=0.05, event_log_capacity=2)
    with SimCluster([config]) as sim:
        router = start_router(log_dir, sim.urls, "--policy", "cache_aware")
        try:
            url = sim.urls[0]

            def resynced_after_gap() -> bool:
                bodies = [{"prompt": prompt(3000 + i, 64), "max_tokens": 1} for i in range(24)]
                asyncio.run(complete_many(router, bodies))
                metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
                return labelled_metric(metrics, "kvyard_router_index_resyncs_total", reason="gap") >= 1

            wait_for(resynced_after_gap, 60, "a gap in the KV events and a resync")
            snapshot = httpx.get(f"{url}/kv/snapshot", headers=ADMIN, timeout=10).json()
            wait_for(lambda: replica_state(router, url)["index_seq"] == snapshot["seq"], 10, "index caught up")
            assert replica_state(router, url)["index_blocks"] == len(snapshot["block_keys"])
        finally:
            router.stop()


def test_admin_api_adds_drains_and_removes_replicas(cluster: SimCluster, log_dir: Path) -> None:
    router = start_router(log_dir, cluster.urls[:1], "--policy", "round_robin")
    try:
        added = httpx.post(
            f"{router.url}/admin/replicas",
            headers=ADMIN,
            timeout=10,
            json={"url": cluster.urls[1], "admin_key": TEST_ADMIN_KEY},
        )  # its key: for its KV events
        assert added.status_code == 200 and added.json()["url"] == cluster.urls[1]
        wait_for(lambda: all(r["state"] == "healthy" and r["models"] for r in replicas_of(router)), 20, "healthy")
        assert {served_by(complete(router, {"prompt": prompt(i, 8)})) for i in range(6)} == set(cluster.urls[:2])
        admin(router, "POST", "/admin/replicas/drain", json={"url": cluster.urls[0]}).raise_for_status()
        assert {served_by(complete(router, {"prompt": prompt(i, 8)})) for i in range(4)} == {cluster.urls[1]}
        removed = admin(router, "DELETE", "/admin/replicas", params={"url": cluster.urls[1]})
        assert removed.status_code == 200
        response = complete(router, {"prompt": prompt(1, 8)})
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["code"] == "no_replica"
    finally:
        router.stop()


@pytest.mark.parametrize("panic_threshold", ["0.5", "0"])
def test_when_every_replica_fails_its_health_checks_the_router_still_serves_unless_panic_is_off(
    cluster: SimCluster, log_dir: Path, panic_threshold: str
) -> None:
    """Health checks that cannot finish in time (an overloaded fleet's) eject every replica. Below the panic
    threshold the router routes to ejected replicas too, and they serve; with panic off it answers 503."""
    router = start_router(
        log_dir,
        cluster.urls[:2],
        "--health-timeout-s",
        "0.000001",
        "--panic-threshold",
        panic_threshold,
        wait_healthy=False,
    )
    try:
        wait_for(lambda: all(r["state"] == "ejected" for r in replicas_of(router)), 20, "both replicas ejected")
        response = complete(router, {"prompt": prompt(3, 8)})
        metrics = httpx.get(f"{router.url}/metrics", headers=ADMIN, timeout=10).text
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503  # no replica passes its checks
        assert "kvyard_router_healthy_replicas 0.0" in metrics
        if panic_threshold == "0":
            assert response.status_code == 503 and response.json()["error"]["code"] == "no_replica"
            assert "kvyard_router_panic 0.0" in metrics
        else:
            assert response.status_code == 200, response.text
            assert served_by(response) in cluster.urls[:2]
            assert "kvyard_router_panic 1.0" in metrics
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--panic-threshold", "1.5", "--panic-threshold must be between 0 and 1"),
        ("--shared-index-keys", "0", "--shared-index-keys must be at least 1"),
        ("--backlog", "0", "backlog must be positive"),
        ("--conversation-weight", "-1", "--conversation-weight must be 0 or more"),
    ],
)
def test_out_of_range_settings_are_refused_with_the_reason(option: str, value: str, reason: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "route", "--replica", "http://127.0.0.1:1", option, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and reason in result.stderr


def test_full_router_queue_answers_429_with_retry_after(cluster: SimCluster, log_dir: Path) -> None:
    router = start_router(log_dir, cluster.urls[:1], "--max-in-flight", "1")
    try:
        bodies = [{"prompt": prompt(i, 32), "max_tokens": 400, "ignore_eos": True} for i in range(6)]
        responses = asyncio.run(complete_many(router, bodies))
        rejected = [r for r in responses if r.status_code == 429]
        assert rejected and any(r.status_code == 200 for r in responses)
        assert all(r.headers["retry-after"] and r.json()["error"]["code"] == "overloaded" for r in rejected)
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert labelled_metric(metrics, "kvyard_router_rejected_total", reason="queue_full") == len(rejected)
    finally:
        router.stop()

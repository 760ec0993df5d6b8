"""Rate limits per client: token buckets on a fake clock, and 429 with Retry-After from a live replica."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from kvyard.api.errors import APIError
from kvyard.api.ratelimit import BURST_S, RateLimiter
from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import SimCluster, sim_server_options
from tests.router_utils import start_router


def admitted(limiter: RateLimiter, client: str, tokens: int, now: float) -> bool:
    try:
        limiter.admit(client, tokens, now)
    except APIError as error:
        assert error.status == 429 and error.retry_after is not None and error.retry_after >= 1
        return False
    return True


def test_requests_per_minute_allow_a_burst_then_the_rate() -> None:
    limiter = RateLimiter(requests_per_min=600)  # 10/s, a burst of 10 s worth
    burst = sum(admitted(limiter, "a", 0, 0.0) for _ in range(200))
    assert burst == 10 * BURST_S
    # Over the next 30 s, offered 40/s: exactly the rate gets through.
    through = sum(admitted(limiter, "a", 0, t / 40) for t in range(1, 40 * 30 + 1))
    assert through == pytest.approx(10 * 30, abs=1)
    assert admitted(limiter, "b", 0, 30.0)  # another client has its own bucket


def test_tokens_per_minute_count_prompt_and_max_tokens() -> None:
    limiter = RateLimiter(tokens_per_min=6000)  # 100 tokens/s, 1,000 at once
    assert admitted(limiter, "a", 600, 0.0)
    assert not admitted(limiter, "a", 600, 0.0)  # nothing was taken by the refusal
    assert admitted(limiter, "a", 400, 0.0)
    assert admitted(limiter, "a", 600, 6.0)  # refilled
    assert admitted(limiter, "b", 10**6, 0.0)  # larger than a full bucket: let through when the bucket is full
    assert not admitted(limiter, "b", 1, 0.0)


def test_a_replica_answers_429_with_retry_after_past_a_clients_rate() -> None:
    config = SimConfig(model_name="m", block_size=4, num_kv_blocks=64, time_scale=0.01)
    options = sim_server_options(api_keys=["k1", "k2"], requests_per_min=6)  # a burst of one request
    with SimCluster([config], options) as sim:
        url = f"{sim.urls[0]}/v1/completions"

        def post(key: str) -> httpx.Response:
            return httpx.post(url, json={"prompt": [1, 2], "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"})

        assert post("k1").status_code == 200
        refused = post("k1")
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limited"
        assert post("k2").status_code == 200  # per key


def test_a_router_limits_tokens_per_key() -> None:
    config = SimConfig(model_name="m", block_size=4, num_kv_blocks=64, time_scale=0.01)
    with SimCluster([config], sim_server_options()) as sim, tempfile.TemporaryDirectory() as logs:
        router = start_router(Path(logs), sim.urls, "--api-key", "k1", "--api-key", "k2", "--tokens-per-min", "600")
        try:  # 10 tokens/s, a burst of 100

            def post(key: str, max_tokens: int) -> httpx.Response:
                body = {"prompt": [1] * 40, "max_tokens": max_tokens}
                return httpx.post(
                    f"{router.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
                )

            assert post("k1", 50).status_code == 200  # 90 of 100
            refused = post("k1", 20)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
            assert post("k2", 50).status_code == 200
        finally:
            router.stop()

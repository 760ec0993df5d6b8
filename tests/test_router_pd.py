"""The router in front of prefill and decode replicas: real `kvyard serve` and `kvyard route` processes on
loopback. Outputs equal a unified run; conditional disaggregation keeps short work on the decode replica;
replicas of different models are never paired; a dead prefill replica costs nothing but time."""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_utils import replica_state, start_router, wait_for
from server_utils import ServerProcess, start_server

from kvyard.testing.create_model import create_model

BLOCK_SIZE = 16


def make_prompt(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 1000) for _ in range(length)]


def complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def text_of(result: dict[str, Any]) -> str:
    return str(result["choices"][0]["text"])


def samples(url: str, prefix: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith(prefix)
        for name, value in [line.rsplit(" ", 1)]
    }


def pulled_blocks(decode: ServerProcess) -> float:
    name = "kvyard_kv_transfer_pulled_blocks_total"
    return sum(samples(decode.url, name).values())  # one sample, labelled with the model served


def pd_paths(router: ServerProcess) -> dict[str, float]:
    found = samples(router.url, "kvyard_router_pd_requests_total")
    return {name.split('"')[1]: value for name, value in found.items()}


@pytest.fixture(scope="module")
def fleet(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """A prefill and a decode replica (roles read from their /load) and a router that disaggregates prompts
    with more than 64 tokens to compute on the decode replica."""
    logs = tmp_path_factory.mktemp("router-pd")
    prefill = start_server(llama_dir, logs, "--role", "prefill", "--kv-tier", "none")
    decode = start_server(llama_dir, logs, "--role", "decode", "--kv-tier", "none")
    reference = start_server(llama_dir, logs, "--kv-tier", "none")
    router = start_router(logs, [prefill.url, decode.url], "--pd-local-prefill-tokens", "64")
    yield {"prefill": prefill, "decode": decode, "reference": reference, "router": router}
    for server in (router, prefill, decode, reference):
        server.stop()


def test_routed_pd_equals_unified_and_moves_the_kv(fleet: dict[str, ServerProcess]) -> None:
    router, decode = fleet["router"], fleet["decode"]
    prompt = make_prompt(1, 300)
    before, paths_before = pulled_blocks(decode), pd_paths(router)
    result = complete(router.url, prompt)
    assert text_of(result) == text_of(complete(fleet["reference"].url, prompt))
    assert pulled_blocks(decode) - before == (300 - 1) // BLOCK_SIZE
    assert pd_paths(router).get("remote", 0) == paths_before.get("remote", 0) + 1
    streamed = httpx.post(
        f"{router.url}/v1/completions",
        json={"prompt": make_prompt(2, 300), "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True},
        timeout=120,
    )
    assert streamed.status_code == 200
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
    assert text == text_of(complete(fleet["reference"].url, make_prompt(2, 300)))


def test_a_continuing_turn_prefills_on_its_decode_replica(fleet: dict[str, ServerProcess]) -> None:
    router, decode = fleet["router"], fleet["decode"]
    history = make_prompt(3, 300)
    first = complete(router.url, history, user="session-3")
    turn = history + make_prompt(4, 40)
    time.sleep(0.5)  # the router's index learns the decode replica's new blocks from its KV events
    before, paths_before = pulled_blocks(decode), pd_paths(router)
    result = complete(router.url, turn, user="session-3")
    assert pd_paths(router).get("short", 0) == paths_before.get("short", 0) + 1
    assert pulled_blocks(decode) == before  # nothing moved: the history was on the decode replica
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 300 // BLOCK_SIZE * BLOCK_SIZE
    assert text_of(result) == text_of(complete(fleet["reference"].url, turn))
    assert text_of(first) == text_of(complete(fleet["reference"].url, history))


def test_replicas_of_different_models_are_never_paired(llama_dir: Path, tmp_path: Path) -> None:
    other = create_model("llama", "tiny", tmp_path / "other", seed=7)  # same architecture, other weights
    prefill = start_server(other, tmp_path, "--kv-tier", "none", "--served-model-name", llama_dir.name)
    decode = start_server(llama_dir, tmp_path, "--kv-tier", "none")
    router = start_router(tmp_path, [], "--prefill", prefill.url, "--decode", decode.url, "--disaggregation", "always")
    try:
        response = httpx.post(
            f"{router.url}/v1/completions", json={"prompt": make_prompt(5, 100), "max_tokens": 4}, timeout=60
        )
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "pd_model_mismatch"
        assert prefill.url in error["message"] and decode.url in error["message"]
    finally:
        for server in (router, prefill, decode):
            server.stop()


def test_a_dead_prefill_replica_costs_only_time(llama_dir: Path, tmp_path: Path) -> None:
    prefill = start_server(llama_dir, tmp_path, "--kv-tier", "none")
    decode = start_server(llama_dir, tmp_path, "--kv-tier", "none")
    router = start_router(tmp_path, [], "--prefill", prefill.url, "--decode", decode.url, "--disaggregation", "always")
    try:
        prompt = make_prompt(6, 200)
        expected = text_of(complete(decode.url, prompt, cache_salt="reference"))
        prefill.process.send_signal(signal.SIGKILL)
        prefill.process.wait()
        assert text_of(complete(router.url, prompt)) == expected  # the decode replica computed it all
        legs = samples(router.url, "kvyard_router_pd_prefill_legs_total")
        assert legs == {'kvyard_router_pd_prefill_legs_total{outcome="connect"}': 1.0}, legs
        wait_for(lambda: replica_state(router, prefill.url)["state"] == "ejected", 20, "prefill replica ejected")
        assert text_of(complete(router.url, make_prompt(7, 200))) == text_of(
            complete(decode.url, make_prompt(7, 200), cache_salt="reference")
        )
    finally:
        for server in (router, prefill, decode):
            server.stop()

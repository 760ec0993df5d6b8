"""`kvyard route` in front of real `kvyard serve` replicas (tiny llama): failures, restarts, tokenization."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router_utils import labelled_metric, replica_state, start_router, wait_for
from tests.server_utils import ADMIN, ServerProcess, start_server

CHAT = [
    {"role": "system", "content": "You are a careful assistant. " * 12},
    {"role": "user", "content": "Summarise the plot of a long novel about ships, storms and a lighthouse."},
]


@pytest.fixture(scope="module")
def survivor(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A replica that outlives every test of this module."""
    replica = start_server(llama_dir, tmp_path_factory.mktemp("survivor"))
    yield replica
    replica.stop()


def _request(index: int, stream: bool) -> tuple[str, dict[str, Any]]:
    """Even requests are completions, odd ones chats; greedy, of a fixed length."""
    body = {"max_tokens": 300, "ignore_eos": True, "stream": stream, "temperature": 0.0}
    if index % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"story {index}, please"}]}
    return "/v1/completions", {**body, "prompt": f"request {index}: tell a story"}


def _text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"])
    return str((choice.get("delta") or choice.get("message") or {}).get("content") or "")


@dataclass
class StreamWatch:
    """Counts the streams through `replica` that have received `chunks` chunks, so a test can act mid-stream."""

    replica: str
    chunks: int = 10
    started: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    wanted: int = 4

    def saw(self, replica: str | None, num_chunks: int) -> None:
        if replica == self.replica and num_chunks == self.chunks:
            self.started += 1
            if self.started >= self.wanted:
                self.event.set()


async def _stream(client: httpx.AsyncClient, url: str, index: int, watch: StreamWatch | None = None) -> dict[str, Any]:
    path, body = _request(index, stream=True)
    events: list[str] = []
    comments = 0
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        async for line in response.aiter_lines():
            comments += line.startswith(":")
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if watch is not None:
                    watch.saw(response.headers.get("x-kvyard-replica"), len(events))
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    return {
        "status": response.status_code,
        "replica": response.headers.get("x-kvyard-replica"),
        "done": events[-1:] == ["[DONE]"],
        "errors": [c["error"] for c in chunks if "error" in c],
        "text": "".join(_text(c) for c in choices),
        "finish": [c["finish_reason"] for c in choices][-1:],
        "roles": sum("role" in c.get("delta", {}) for c in choices),
        "ids": {c["id"] for c in chunks if "id" in c},
        "leaked_progress": comments > 0 or any("token_ids" in c for c in choices),
    }


async def _references(url: str, count: int) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(
            *(client.post(f"{url}{path}", json=body) for path, body in map(_request, range(count), [False] * count))
        )
    return [_text(response.json()["choices"][0]) for response in responses]


async def _load_and_kill(router: ServerProcess, victim: ServerProcess, count: int) -> list[dict[str, Any]]:
    """Kill the victim once four of its streams are under way (each has its first ten chunks)."""
    watch = StreamWatch(victim.url)
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(_stream(client, router.url, i, watch)) for i in range(count)]
        await asyncio.wait_for(watch.event.wait(), timeout=120)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        return await asyncio.gather(*tasks)


def test_a_replica_killed_under_greedy_streams_truncates_none(
    llama_dir: Path, tmp_path: Path, survivor: ServerProcess
) -> None:
    count = 16
    references = asyncio.run(_references(survivor.url, count))
    replicas = [start_server(llama_dir, tmp_path), survivor]
    router = start_router(tmp_path, [r.url for r in replicas], "--policy", "round_robin")
    try:
        victim = replicas[0]
        results = asyncio.run(_load_and_kill(router, victim, count))
        resumed = 0
        for index, result in enumerate(results):
            assert result["status"] == 200 and result["done"] and not result["errors"], result
            assert result["finish"] == ["length"] and len(result["ids"]) == 1 and not result["leaked_progress"], result
            assert result["roles"] == index % 2  # a chat stream has one role chunk, resumed or not
            assert result["text"] == references[index], (index, result["replica"])
            resumed += result["replica"] == victim.url
        assert resumed >= 2  # streams begun on the killed replica were finished by the survivor
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert labelled_metric(metrics, "kvyard_router_retries_total", reason="broken_mid_stream") >= 2
        assert labelled_metric(metrics, "kvyard_router_ejections_total", replica=victim.url) >= 1
        assert replica_state(router, victim.url)["state"] == "ejected"
        response = httpx.post(f"{router.url}/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
        assert response.status_code == 200 and response.headers["x-kvyard-replica"] == replicas[1].url
    finally:
        router.stop()
        replicas[0].stop()


def _chat(router: ServerProcess) -> httpx.Response:
    response = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def _parity(router: ServerProcess) -> tuple[float, float]:
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    return (
        labelled_metric(metrics, "kvyard_router_predicted_cached_tokens_total"),
        labelled_metric(metrics, "kvyard_router_reported_cached_tokens_total"),
    )


def test_restarted_replica_loses_its_stale_index_entries(llama_dir: Path, tmp_path: Path) -> None:
    replica = start_server(llama_dir, tmp_path)
    (tmp_path / "restarted").mkdir()
    router = start_router(tmp_path, [replica.url], "--policy", "cache_aware")
    try:
        first = _chat(router)
        wait_for(lambda: replica_state(router, replica.url)["index_blocks"] > 0, 20, "index filled from events")
        second = _chat(router)
        reported = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported > 0 and reported >= first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        predicted_total, reported_total = _parity(router)
        assert predicted_total == reported_total, "router tokenization must agree with the replica's"

        resyncs = replica_state(router, replica.url)["resyncs"]
        replica.process.kill()  # a crash: the next process on this port starts with an empty cache
        replica.process.wait()
        replica = start_server(llama_dir, tmp_path / "restarted", port=replica.port)
        wait_for(lambda: replica_state(router, replica.url)["resyncs"] > resyncs, 30, "index reloaded")
        wait_for(lambda: replica_state(router, replica.url)["state"] == "healthy", 30, "re-admitted")
        snapshot = httpx.get(f"{replica.url}/kv/snapshot", headers=ADMIN, timeout=10).json()
        assert replica_state(router, replica.url)["index_blocks"] == len(snapshot["block_keys"])
        third = _chat(router)  # the fresh replica holds nothing: the router must not predict a hit
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _parity(router) == (predicted_total, reported_total)
    finally:
        router.stop()
        replica.stop()


def test_client_disconnect_is_propagated_upstream(tmp_path: Path, survivor: ServerProcess) -> None:
    replica = survivor
    router = start_router(tmp_path, [replica.url], "--policy", "least_load")
    try:
        max_model_len = httpx.get(f"{replica.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        body = {"prompt": "a long story", "max_tokens": max_model_len - 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            next(response.iter_raw())
        # The client is gone: the replica must stop generating rather than run to max_tokens.
        wait_for(lambda: httpx.get(f"{replica.url}/load", timeout=5).json()["num_running"] == 0, 30, "cancelled")
        assert replica_state(router, replica.url)["in_flight"] == 0
    finally:
        router.stop()

"""Prefill/decode disaggregation end to end: real `kvyard serve` processes on loopback, one prefilling and one
decoding, with the KV moved between them; outputs compared token for token with a unified run."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pd_utils import PD_HEADERS, Relay, decode_body, pd_request, prefill_body
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ADMIN, ServerProcess, start_server

from kvyard.api.metrics import MODEL_NAME
from kvyard.kvcache.pd_stream import RELEASE_PATH, TRANSFER_TOKEN_HEADER
from kvyard.testing.sim_cluster import TEST_ADMIN_KEY

BLOCK_SIZE = 16


def make_prompt(seed: int, length: int = 300) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 1000) for _ in range(length)]


def body_of(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics whose name starts with kvyard_kv_transfer, its labels but the model's kept in the
    name."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvyard_kv_transfer"):
                labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items() if key != MODEL_NAME)
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def unified(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    """The reference: the whole request on one replica, under a salt no other request uses (no cache hits)."""
    response = httpx.post(
        f"{server.url}/v1/completions", json={**body, "cache_salt": f"ref-{random.random()}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def tokens_of(result: dict[str, Any]) -> list[str]:
    return [choice["text"] for choice in sorted(result["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(
    request: pytest.FixtureRequest, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A prefill replica (small chunks, so a prompt prefills over several steps) and a decode replica."""
    logs = tmp_path_factory.mktemp(f"pd-{request.param}")
    model = model_dirs[request.param]
    prefill = start_server(model, logs, "--role", "prefill", "--max-num-batched-tokens", "64", "--kv-tier", "none")
    decode = start_server(model, logs, "--role", "decode", "--kv-tier", "none")
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_pd_output_equals_unified_and_the_kv_was_pulled(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    body = body_of(make_prompt(1))
    before = metrics(decode)
    result = pd_request(prefill.url, decode.url, body).json()
    assert tokens_of(result) == tokens_of(unified(decode, body))
    after = metrics(decode)
    wanted_blocks = (300 - 1) // BLOCK_SIZE
    assert after["kvyard_kv_transfer_pulled_blocks_total"] - before["kvyard_kv_transfer_pulled_blocks_total"] == (
        wanted_blocks
    )
    assert after["kvyard_kv_transfer_pulls_complete_total"] == before["kvyard_kv_transfer_pulls_complete_total"] + 1
    # Nothing was computed from a cache on the prefill side: the decode replica reports no cached tokens.
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_pd_streaming_and_n_choices(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    body = body_of(make_prompt(2), n=3)
    reference = tokens_of(unified(decode, body))
    assert tokens_of(pd_request(prefill.url, decode.url, body).json()) == reference
    stream_body = body_of(make_prompt(3), stream=True)
    reference_text = tokens_of(unified(decode, body_of(make_prompt(3))))[0]
    result = pd_request(prefill.url, decode.url, stream_body)
    assert result.decode.status_code == 200
    chunks = [json.loads(line[6:]) for line in result.decode.text.splitlines() if line.startswith("data: {")]
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
    assert text == reference_text


def test_pd_with_prefix_cache_hits_on_either_side(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    history = make_prompt(4, 200)
    first = body_of(history, cache_salt="session-4")
    assert pd_request(prefill.url, decode.url, first).json()
    # The next turn extends the history: the prefill replica has its first 12 blocks cached, the decode replica
    # too (it registered the pulled blocks), so it pulls only the new ones.
    turn = body_of(history + make_prompt(5, 100), cache_salt="session-4")
    before = metrics(decode)
    result = pd_request(prefill.url, decode.url, turn).json()
    reference = unified(decode, turn)
    assert tokens_of(result) == tokens_of(reference)
    pulled_key = "kvyard_kv_transfer_pulled_blocks_total"
    pulled = metrics(decode)[pulled_key] - before[pulled_key]
    assert pulled == (300 - 1) // BLOCK_SIZE - 200 // BLOCK_SIZE
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 200 // BLOCK_SIZE * BLOCK_SIZE


def test_the_prefill_side_releases_its_blocks(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    pd_request(prefill.url, decode.url, body_of(make_prompt(6))).json()
    deadline = time.monotonic() + 10
    while metrics(prefill)["kvyard_kv_transfer_leased_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(prefill)["kvyard_kv_transfer_leased_blocks"] == 0
    assert httpx.get(f"{prefill.url}/load", timeout=10).json()["kv_blocks_used"] == 0


def test_a_corrupt_block_is_recomputed(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    relay = Relay(prefill.port, flip_at=2000)  # inside the first block, past the HTTP head
    try:
        body = body_of(make_prompt(7))
        before = metrics(decode)
        result = pd_request(prefill.url, decode.url, body, source=relay.url).json()
        assert relay.flipped == 1
        assert tokens_of(result) == tokens_of(unified(decode, body))
        after = metrics(decode)
        key = 'kvyard_kv_transfer_fallbacks_total{reason="corrupt"}'
        assert after[key] == before.get(key, 0) + 1
    finally:
        relay.close()


def test_kv_transfer_params_need_the_admin_key(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    body = body_of(
        make_prompt(8),
        kv_transfer_params={"do_remote_prefill": True, "transfer_id": "x" * 16, "source": "http://127.0.0.1:9"},
    )
    response = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 401
    assert "kv_transfer_params" in response.json()["error"]["message"]
    for bad, field in (
        ({"transfer_id": "x" * 16}, "kv_transfer_params"),
        ({"do_remote_prefill": True, "transfer_id": "x" * 16}, "kv_transfer_params"),
        ({"do_remote_decode": True, "transfer_id": "short"}, "kv_transfer_params.transfer_id"),
        ({"do_remote_prefill": True, "transfer_id": "x" * 16, "source": "file:///etc"}, "kv_transfer_params.source"),
    ):
        response = httpx.post(
            f"{decode.url}/v1/completions", json=body_of([5, 6], kv_transfer_params=bad), headers=PD_HEADERS, timeout=30
        )
        assert response.status_code == 400, bad
        assert response.json()["error"]["param"] == field, response.text
    reading = httpx.get(f"{prefill.url}/kv/transfer", params={"id": "x" * 16}, timeout=30)
    assert reading.status_code == 401
    with httpx.stream("GET", f"{prefill.url}/kv/transfer", params={"id": "x" * 16}, headers=ADMIN) as admitted:
        assert admitted.status_code == 200


def test_a_transfers_blocks_go_to_its_token_and_the_pull_shows_nothing_else(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """The decode replica shows the prefill replica the transfer's token, never its own admin key; the prefill
    replica streams the blocks to that token (or to the admin) and refuses any other."""
    prefill, decode = pair
    transfer_id, token = uuid.uuid4().hex, uuid.uuid4().hex
    leg = httpx.post(
        f"{prefill.url}/v1/completions",
        json=prefill_body(body_of(make_prompt(11)), transfer_id, token),
        headers=PD_HEADERS,
        timeout=60,
    )
    assert leg.status_code == 200, leg.text
    wrong = httpx.get(
        f"{prefill.url}/kv/transfer",
        params={"id": transfer_id},
        headers={TRANSFER_TOKEN_HEADER: uuid.uuid4().hex},
        timeout=30,
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_transfer_token"
    with httpx.stream(
        "GET",
        f"{prefill.url}/kv/transfer",
        params={"id": transfer_id},
        headers={TRANSFER_TOKEN_HEADER: token},
        timeout=30,
    ) as right:
        assert right.status_code == 200 and right.headers["content-type"] == "application/octet-stream"
    released = httpx.post(
        f"{prefill.url}{RELEASE_PATH}", params={"id": transfer_id}, headers={TRANSFER_TOKEN_HEADER: token}, timeout=30
    )
    assert released.status_code == 200
    with stranger_source() as (source, seen):
        answer = httpx.post(
            f"{decode.url}/v1/completions",
            headers=PD_HEADERS,
            timeout=60,
            json=decode_body(body_of(make_prompt(12)), uuid.uuid4().hex, source, token),
        )
        assert answer.status_code == 200, answer.text  # nothing pulled: the prompt computed here
    assert seen and all(headers.get(TRANSFER_TOKEN_HEADER.lower()) == token for headers in seen), seen
    everything = " ".join(f"{name}: {value}" for headers in seen for name, value in headers.items()).lower()
    assert TEST_ADMIN_KEY.lower() not in everything and "authorization" not in everything


@contextlib.contextmanager
def stranger_source() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A 'prefill replica' that records the headers of what it is asked, and has nothing to give."""
    seen: list[dict[str, str]] = []

    class Stranger(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append({name.lower(): value for name, value in self.headers.items()})
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()


def test_a_prefill_replica_killed_mid_transfer_falls_back(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = model_dirs["llama"]
    prefill = start_server(model, tmp_path, "--kv-tier", "none")
    decode = start_server(model, tmp_path, "--kv-tier", "none")
    # The decode replica pulls through a relay that passes the first few blocks (8 KiB each for the tiny
    # Llama) and holds the rest, so the kill always lands mid-transfer however fast the prefill is.
    relay = Relay(prefill.port, hold_at=5 * 8192)
    try:
        body = body_of(make_prompt(9, 1500))
        reference = tokens_of(unified(decode, body))
        before = metrics(decode)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(pd_request, prefill.url, decode.url, body, source=relay.url)
            assert relay.holding.wait(60)
            prefill.process.send_signal(signal.SIGKILL)
            result = running.result()
        assert result.decode.status_code == 200, result.decode.text
        assert tokens_of(result.decode.json()) == reference
        after = metrics(decode)
        fallbacks = {k: v for k, v in after.items() if k.startswith("kvyard_kv_transfer_fallbacks_total")}
        assert fallbacks == {'kvyard_kv_transfer_fallbacks_total{reason="connection_lost"}': 1.0}, fallbacks
        pulled_key = "kvyard_kv_transfer_pulled_blocks_total"
        pulled = after[pulled_key] - before.get(pulled_key, 0)
        assert 1 <= pulled < (1500 - 1) // BLOCK_SIZE
    finally:
        relay.close()
        prefill.stop()
        decode.stop()


def test_no_lease_outlives_its_decode_side(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """500 prefills for decode replicas that pull and release, die halfway through a pull, or never come: once
    the leases have run out the prefill replica's pool is back where it started."""
    prefill = start_server(model_dirs["llama"], tmp_path, "--kv-lease-s", "2", "--kv-tier", "none")
    fates = random.Random(0)
    plans = [(index, fates.choice(["release", "die_mid_pull", "never_come"])) for index in range(500)]
    released_ok: list[int] = []

    def run(plan: tuple[int, str]) -> None:
        index, fate = plan
        transfer_id = f"lease-test-{index:04d}"
        body = prefill_body(body_of(make_prompt(1000 + index, 40)), transfer_id)
        response = httpx.post(f"{prefill.url}/v1/completions", json=body, headers=PD_HEADERS, timeout=60)
        assert response.status_code == 200, response.text
        if fate == "release":
            with httpx.stream(
                "GET", f"{prefill.url}/kv/transfer", params={"id": transfer_id}, headers=ADMIN, timeout=60
            ) as stream:
                assert stream.status_code == 200
                stream.read()
            released = httpx.post(f"{prefill.url}/kv/transfer/release", params={"id": transfer_id}, headers=ADMIN)
            # On a loaded machine the lease may run out between the pull and the release: then it is gone already.
            gone = released.status_code == 404 and released.json()["error"]["code"] == "transfer_not_found"
            assert released.status_code == 200 or gone, released.text
            if released.status_code == 200:
                released_ok.append(index)
        elif fate == "die_mid_pull":
            with httpx.stream(
                "GET", f"{prefill.url}/kv/transfer", params={"id": transfer_id}, headers=ADMIN, timeout=60
            ) as stream:
                next(stream.iter_bytes())

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(run, plans))
        counts = metrics(prefill)
        assert counts["kvyard_kv_transfer_exports_total"] == 500
        assert 0 < len(released_ok) <= sum(fate == "release" for _, fate in plans)
        assert counts["kvyard_kv_transfer_leases_released_total"] == len(released_ok)
        deadline = time.monotonic() + 10
        while metrics(prefill)["kvyard_kv_transfer_active_leases"] and time.monotonic() < deadline:
            time.sleep(0.1)
        counts = metrics(prefill)
        assert counts["kvyard_kv_transfer_active_leases"] == 0
        assert counts["kvyard_kv_transfer_leased_blocks"] == 0
        released = counts["kvyard_kv_transfer_leases_released_total"]
        assert counts["kvyard_kv_transfer_leases_expired_total"] == 500 - released
        assert httpx.get(f"{prefill.url}/load", timeout=10).json()["kv_blocks_used"] == 0
    finally:
        prefill.stop()


def test_a_client_that_disconnects_leaks_nothing(pair: tuple[ServerProcess, ServerProcess]) -> None:
    prefill, decode = pair
    body = body_of(make_prompt(10, 600), max_tokens=200, stream=True)
    transfer_id = "disconnect-test-0001"
    with ThreadPoolExecutor(1) as pool:
        leg = pool.submit(
            httpx.post,
            f"{prefill.url}/v1/completions",
            json=prefill_body(body, transfer_id),
            headers=PD_HEADERS,
            timeout=120,
        )
        with httpx.stream(
            "POST",
            f"{decode.url}/v1/completions",
            json=decode_body(body, transfer_id, prefill.url),
            headers=PD_HEADERS,
            timeout=120,
        ) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first token is out: the client goes away mid-stream
        assert leg.result().status_code == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
        metrics(prefill)["kvyard_kv_transfer_leased_blocks"] or httpx.get(f"{decode.url}/load").json()["kv_blocks_used"]
    ):
        time.sleep(0.1)
    assert metrics(prefill)["kvyard_kv_transfer_leased_blocks"] == 0
    assert httpx.get(f"{decode.url}/load", timeout=10).json()["kv_blocks_used"] == 0
    assert httpx.get(f"{prefill.url}/load", timeout=10).json()["kv_blocks_used"] == 0


def test_blocks_reserved_for_a_pull_are_freed_when_its_client_leaves(pair: tuple[ServerProcess, ServerProcess]) -> None:
    """The decode replica reserves blocks for the prompt while it waits for a prefill that never comes; the client
    gives up; once the pull has ended (the prefill replica says the transfer is unknown), the blocks are free."""
    prefill, decode = pair
    body = decode_body(body_of(make_prompt(11, 600)), "never-prefilled-0001", prefill.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{decode.url}/v1/completions", json=body, headers=PD_HEADERS, timeout=2)
    assert httpx.get(f"{decode.url}/load", timeout=10).json()["kv_blocks_used"] == (600 - 1) // BLOCK_SIZE
    deadline = time.monotonic() + 30
    while httpx.get(f"{decode.url}/load", timeout=10).json()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{decode.url}/load", timeout=10).json()["kv_blocks_used"] == 0

"""`kvyard route` in front of real vLLM replicas (vLLM's CPU build serving the demo model), following their own KV
events: the index it keeps is what each replica holds, sessions stay where their cache is, a replica that dies
mid-stream is replaced without the client noticing, and restarts and lost events are recovered from.

The vLLM servers come from `.venv-vllm` (`bash scripts/setup.sh --vllm`; `--tests` makes it too). Without it
these tests are skipped, except under CI, where a missing vLLM is a failure.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_utils import admin, labelled_metric, replica_state, replicas_of, start_router, wait_for
from server_utils import ServerProcess, start_server

from kvyard.testing.model_presets import DEMO_MODEL_DIR
from kvyard.testing.vllm_replicas import VllmReplica, start_vllm, vllm_python, wait_ready

MODEL = "kvyard-demo"

if vllm_python() is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI runs the vLLM tests: `bash scripts/setup.sh --tests` makes .venv-vllm")
    pytest.skip("no .venv-vllm here: run `bash scripts/setup.sh --vllm`", allow_module_level=True)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-fleet")


@pytest.fixture(scope="module")
def fleet(scratch: Path) -> Iterator[list[VllmReplica]]:
    """Two vLLM replicas, each on one core, publishing KV events with a replay socket."""
    cores = os.cpu_count() or 1
    replicas = [start_vllm(DEMO_MODEL_DIR, scratch, served_name=MODEL, cpus=str(i % cores)) for i in range(2)]
    try:
        wait_ready(replicas)
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module")
def router(fleet: list[VllmReplica], scratch: Path) -> Iterator[ServerProcess]:
    events = [option for replica in fleet for option in ("--replica-events", str(replica.events))]
    # A vLLM server busy on a shared core can take seconds to answer a health check: not a reason to eject it here.
    process = start_router(
        scratch, [replica.url for replica in fleet], *events, "--health-timeout-s", "10", timeout=120
    )
    try:
        yield process
    finally:
        process.stop()


def chat(url: str, messages: list[dict[str, str]], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    """A greedy streamed chat completion: its text, usage, token-id fields seen, and the replica that served it."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        replica = response.headers.get("x-kvyard-replica")
        read = read_stream(response)
    return {**read, "replica": replica}


def read_stream(response: httpx.Response, on_first_chunk: Callable[[], None] | None = None) -> dict[str, Any]:
    """A streamed chat completion's text, usage, stream ids and chunk count; `on_first_chunk` runs as the first
    chunk arrives. No chunk may carry an error or token ids the client did not ask for."""
    text, usage, ids, chunks = "", None, set(), 0
    for line in response.iter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        ids.add(chunk["id"])
        chunks += 1
        if chunk.get("prompt_token_ids") or any(choice.get("token_ids") for choice in chunk["choices"]):
            raise AssertionError(f"token ids the client did not ask for were relayed: {chunk}")
        text += "".join(choice["delta"].get("content") or "" for choice in chunk["choices"])
        usage = chunk.get("usage") or usage
        if chunks == 1 and on_first_chunk is not None:
            on_first_chunk()
    return {"text": text, "usage": usage, "ids": ids, "chunks": chunks}


def settled(router: ServerProcess) -> None:
    """Wait until the router's indexes stop changing (the replicas' events of the last answers are in)."""
    seqs: list[int] = []
    for _ in range(100):
        now = [replica["index_seq"] for replica in replicas_of(router)]
        if seqs == now:
            return
        seqs = now
        time.sleep(0.1)


def metrics(router: ServerProcess) -> str:
    return httpx.get(f"{router.url}/metrics", timeout=10).text


def session(number: int, shared: str = "") -> list[dict[str, str]]:
    system = f"{shared}Session {number}. You write short Python functions for file paths. " * 6
    return [{"role": "system", "content": system}]


def test_the_router_learns_kind_block_size_and_load_from_each_replica(router: ServerProcess) -> None:
    for replica in replicas_of(router):
        assert replica["kind"] == "vllm" and replica["kv_events"] and replica["block_size"] == 32
        assert replica["load"]["kv_blocks_total"] > 0 and replica["models"] == [MODEL]


def test_the_index_is_what_each_replica_holds_through_a_multi_turn_run(
    router: ServerProcess, fleet: list[VllmReplica]
) -> None:
    """Every request's predicted cached tokens equal what vLLM reports it found in its prefix cache, sessions stay
    on the replica holding their history, and each replica's own hit counter agrees with the router's sum."""
    before = {replica.url: _vllm_hits(replica) for replica in fleet}
    sessions = [session(number, shared="Shared preamble. " * 8 if number < 2 else "") for number in range(6)]
    homes: dict[int, str] = {}
    for turn in range(4):
        for number, messages in enumerate(sessions):
            messages.append({"role": "user", "content": f"Turn {turn}: check that the path exists. " * 3})
            salt = {"cache_salt": f"tenant-{number % 2}"} if number >= 4 else {}
            answer = chat(router.url, messages, **salt)
            messages.append({"role": "assistant", "content": answer["text"]})
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn:
                assert answer["replica"] == homes[number], f"session {number} moved at turn {turn}"
                assert cached >= 32 * ((answer["usage"]["prompt_tokens"] - 80) // 32), answer["usage"]
            homes[number] = answer["replica"]
            settled(router)
    text = metrics(router)
    assert len(set(homes.values())) == 2, "both replicas serve sessions"
    for replica in fleet:
        predicted = labelled_metric(text, "kvyard_router_predicted_cached_tokens_total", replica=replica.url)
        reported = labelled_metric(text, "kvyard_router_reported_cached_tokens_total", replica=replica.url)
        assert labelled_metric(text, "kvyard_router_cached_tokens_error_total", replica=replica.url) == 0
        assert predicted == reported > 0
        assert _vllm_hits(replica) - before[replica.url] == reported


def _vllm_hits(replica: VllmReplica) -> float:
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return labelled_metric(text, "vllm:prefix_cache_hits_total")


LONG = 8000  # output tokens: the demo model generates 2,000 in about a second, which a slow reader can miss


def _stream_killing_the_server(
    router: ServerProcess, fleet: list[VllmReplica], body: dict[str, Any]
) -> tuple[dict[str, Any], VllmReplica]:
    """Stream `body` through the router, killing the replica serving it as soon as the first chunk arrives: what
    the client read (read_stream) and the replica killed."""
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, timeout=300) as response:
        victim = next(replica for replica in fleet if replica.url == response.headers["x-kvyard-replica"])
        read = read_stream(response, on_first_chunk=victim.kill)
    return read, victim


def _restart(router: ServerProcess, fleet: list[VllmReplica], dead: VllmReplica, scratch: Path) -> None:
    index = fleet.index(dead)
    cores = os.cpu_count() or 1
    fleet[index] = start_vllm(
        DEMO_MODEL_DIR,
        scratch,
        served_name=MODEL,
        port=dead.port,
        events_port=dead.events_port,
        replay_port=dead.replay_port,
        cpus=str(index % cores),
    )
    wait_ready([fleet[index]])
    wait_for(lambda: replica_state(router, dead.url)["state"] == "healthy", 60, "re-admitted")


def test_a_replica_killed_mid_stream_is_replaced_with_the_same_greedy_text(
    router: ServerProcess, fleet: list[VllmReplica], scratch: Path
) -> None:
    messages = [{"role": "user", "content": "Return True if the path exists. " * 4}]
    extra = {"ignore_eos": True}
    reference = httpx.post(
        f"{fleet[0].url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": LONG, "temperature": 0, **extra},
        timeout=300,
    ).json()
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    # On a busy 2-core machine the router can have read the whole answer from the replica's socket by the time
    # the client sees its first chunk: then the kill breaks nothing. The text must be right either way; the
    # failover itself is tried again (with the replica restarted) until a kill lands mid-stream.
    for _ in range(3):
        retries = labelled_metric(metrics(router), "kvyard_router_retries_total", reason="broken_mid_stream")
        read, victim = _stream_killing_the_server(router, fleet, body)
        usage = read["usage"]
        assert read["text"] == reference["choices"][0]["message"]["content"]
        assert len(read["ids"]) == 1 and usage is not None and usage["completion_tokens"] == LONG
        assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        failed_over = labelled_metric(metrics(router), "kvyard_router_retries_total", reason="broken_mid_stream")
        if failed_over == retries + 1:
            break
        assert failed_over == retries, router.log()[-3000:]
        _restart(router, fleet, victim, scratch)
    else:
        pytest.fail(f"three kills all came after the whole answer was relayed: {router.log()[-3000:]}")
    wait_for(lambda: replica_state(router, victim.url)["state"] == "ejected", 30, "the dead replica ejected")
    assert not replica_state(router, victim.url)["kv_events"]  # its index is dropped, not kept stale


def test_a_restarted_replica_without_replay_is_resynced_and_followed_exactly(
    router: ServerProcess, fleet: list[VllmReplica], scratch: Path
) -> None:
    """The replica killed above comes back on the same ports, as a new process with an empty cache and, this time,
    no replay socket: the router must start its index over, never keep the dead process's blocks."""
    dead = next(replica for replica in fleet if replica.process.poll() is not None)
    resyncs = replica_state(router, dead.url)["resyncs"]
    index = fleet.index(dead)
    fleet[index] = start_vllm(
        DEMO_MODEL_DIR,
        scratch,
        served_name=MODEL,
        port=dead.port,
        events_port=dead.events_port,
        replay=False,
        cpus=str(index % (os.cpu_count() or 1)),
    )
    wait_ready([fleet[index]])
    wait_for(lambda: replica_state(router, dead.url)["state"] == "healthy", 60, "re-admitted")
    wait_for(lambda: replica_state(router, dead.url)["resyncs"] > resyncs, 60, "resynced")
    assert replica_state(router, dead.url)["kv_events"]
    errors_before = labelled_metric(metrics(router), "kvyard_router_cached_tokens_error_total", replica=dead.url)
    messages = session(100)
    for turn in range(3):  # sent to the restarted replica itself: the router's prediction is checked on it
        messages.append({"role": "user", "content": f"Turn {turn}: list the files. " * 3})
        answer = chat(dead.url, messages)
        messages.append({"role": "assistant", "content": answer["text"]})
        settled(router)
    other = fleet[1 - index].url
    admin(router, "POST", "/admin/replicas/drain", json={"url": other})  # so that the router sends it there
    try:
        messages.append({"role": "user", "content": "And now the directories. " * 3})
        answer = chat(router.url, messages)
    finally:
        admin(router, "POST", "/admin/replicas", json={"url": other})
    assert answer["replica"] == dead.url and answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
    errors = labelled_metric(metrics(router), "kvyard_router_cached_tokens_error_total", replica=dead.url)
    assert errors == errors_before


def test_a_router_that_missed_the_events_relearns_blocks_from_the_requests_that_hit_them(
    fleet: list[VllmReplica], scratch: Path
) -> None:
    """A router started after a replica filled its cache, with no replay to read (the restarted replica has none):
    the first request that hits those blocks is mispredicted, the blocks it reused are announced again (the router
    asks vLLM to report reused blocks), and the next request on them is predicted exactly."""
    replica = next(r for r in fleet if r.replay_port is None)
    messages = session(200)
    messages.append({"role": "user", "content": "Read the file and count its lines. " * 4})
    chat(replica.url, messages)  # fills the replica's cache while no router listens
    late = start_router(scratch, [replica.url], "--replica-events", str(replica.events), timeout=120)
    try:
        first = chat(late.url, messages, max_tokens=4)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        settled(late)
        second = chat(late.url, messages, max_tokens=4)
        text = metrics(late)
        error = labelled_metric(text, "kvyard_router_cached_tokens_error_total", replica=replica.url)
        cached = first["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert error == cached, "the first request was predicted a miss, the second exactly"
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
    finally:
        late.stop()


def test_a_fleet_of_one_kvyard_and_one_vllm_replica_serves_both(fleet: list[VllmReplica], scratch: Path) -> None:
    kvyard = start_server(DEMO_MODEL_DIR, scratch, "--block-size", "32")
    vllm = fleet[0]
    mixed = start_router(
        scratch, [kvyard.url, vllm.url], "--replica-events", "-", "--replica-events", str(vllm.events), timeout=120
    )
    try:
        kinds = {replica["url"]: replica["kind"] for replica in replicas_of(mixed)}
        assert kinds == {kvyard.url: "kvyard", vllm.url: "vllm"}
        served = set()
        for number in range(6):
            answer = chat(mixed.url, [*session(300 + number), {"role": "user", "content": "Hello. " * 5}])
            assert answer["text"] and answer["usage"]["completion_tokens"] > 0
            served.add(answer["replica"])
        assert served == {kvyard.url, vllm.url}
        assert all(replica["kv_events"] for replica in replicas_of(mixed))
    finally:
        mixed.stop()
        kvyard.stop()

"""Simulated replicas as real HTTP servers on loopback, driven by the openai client and httpx."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvyard.api.metrics import ServerMetrics
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.kvcache.block_key import chain_block_keys
from kvyard.sim.calibration import calibrate_from_json
from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import SimCluster, sim_server_options
from tests.router_utils import labelled_metric
from tests.server_utils import ADMIN, metric_value, model_names

REPO = Path(__file__).resolve().parents[1]
CONFIG = SimConfig(model_name="sim-model", block_size=4, num_kv_blocks=256, time_scale=0.01)
LOAD_FIELDS = {
    "num_waiting",
    "num_running",
    "in_flight_requests",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_usage",
    "tokens_in_flight",
    "role",
    "prefill_s_per_token",
    "local_tier_s_per_block",
    "shared_tier_s_per_block",
    "shared_tier_available",
    "tier_load_deadline_s",
    "tier_load_extension_s_per_block",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    with SimCluster([CONFIG] * 3) as sim:
        yield sim


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll until `condition` holds (asynchronous state, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def events_page(url: str, since: int = 0) -> dict[str, Any]:
    page: dict[str, Any] = httpx.get(f"{url}/kv/events", headers=ADMIN, params={"since": since, "stream": False}).json()
    return page


def live_keys(events: list[dict[str, Any]]) -> set[str]:
    live: set[str] = set()
    for event in events:
        if event["type"] == "stored":
            live.update(event["block_keys"])
        else:
            live.difference_update(event["block_keys"])
    return live


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(length)]


def aborts(url: str) -> float:
    return labelled_metric(httpx.get(f"{url}/metrics").text, "kvyard_requests_total", outcome="abort")


# ---------------------------------------------------------------------------- completions and usage


def test_repeated_prefix_reports_cached_tokens(cluster: SimCluster) -> None:
    client = client_for(cluster.urls[0])
    tokens = prompt(1, 30)
    first = client.completions.create(model="sim-model", prompt=tokens, max_tokens=5)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (30, 5)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].finish_reason == "length" and len(first.choices[0].text) == 5
    stream = client.completions.create(
        model="sim-model", prompt=[*tokens, 5, 6, 7], max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 28  # seven full blocks of 4 of the shared 30 tokens
    assert chunks[-2].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model="sim-model", prompt=[*tokens, 5, 6, 7], max_tokens=5)
    assert whole.choices[0].text == streamed  # the output is a function of the prompt
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 32


def test_chat_answer_text_round_trips_into_the_next_turn(cluster: SimCluster) -> None:
    client, url = client_for(cluster.urls[1]), cluster.urls[1]
    first_turn = [{"role": "user", "content": "tell me about prefix caches"}]
    reply = client.chat.completions.create(model="sim-model", messages=first_turn, max_tokens=12)  # type: ignore[arg-type]
    answer = reply.choices[0].message.content
    assert answer and len(answer) == 12
    second_turn = [*first_turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    again = client.chat.completions.create(model="sim-model", messages=second_turn, max_tokens=4)  # type: ignore[arg-type]
    first_prompt = httpx.post(f"{url}/tokenize", json={"messages": first_turn}).json()["tokens"]
    assert reply.usage is not None and again.usage is not None and again.usage.prompt_tokens_details is not None
    # Everything computed in turn one (its prompt and all but the last answer token) is reusable.
    computed = len(first_prompt) + len(answer) - 1
    assert again.usage.prompt_tokens_details.cached_tokens == computed // 4 * 4


def test_cache_salt_isolates_tenants(cluster: SimCluster) -> None:
    client = client_for(cluster.urls[0])
    tokens = prompt(2, 21)
    client.completions.create(model="sim-model", prompt=tokens, max_tokens=1, extra_body={"cache_salt": "a"})
    other = client.completions.create(model="sim-model", prompt=tokens, max_tokens=1, extra_body={"cache_salt": "b"})
    same = client.completions.create(model="sim-model", prompt=tokens, max_tokens=1, extra_body={"cache_salt": "a"})
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert same.usage is not None and same.usage.prompt_tokens_details is not None
    assert (other.usage.prompt_tokens_details.cached_tokens, same.usage.prompt_tokens_details.cached_tokens) == (0, 20)


# ---------------------------------------------------------------------------- KV events


def test_lru_eviction_at_capacity_shows_up_as_removed_events() -> None:
    config = replace(CONFIG, num_kv_blocks=6)
    with SimCluster([config]) as sim:
        url, client = sim.urls[0], client_for(sim.urls[0])
        first, second = prompt(3, 13), prompt(4, 13)
        namespace_root = sim.replicas[0].core.root_key(None)
        first_keys = [k.hex() for k in chain_block_keys(namespace_root, first, 4)]
        client.completions.create(model="sim-model", prompt=first, max_tokens=1)
        assert [e["type"] for e in events_page(url)["events"]] == ["stored"]
        client.completions.create(model="sim-model", prompt=second, max_tokens=1)  # needs 4 of 6 blocks: evicts one
        page = events_page(url)
        assert [(e["type"], e["block_keys"]) for e in page["events"][1:2]] == [("removed", [first_keys[2]])]
        again = client.completions.create(model="sim-model", prompt=first, max_tokens=1)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == 8  # the tail block went first, the prefix stayed
        snapshot = httpx.get(f"{url}/kv/snapshot", headers=ADMIN).json()
        assert len(snapshot["block_keys"]) <= 6
        assert set(snapshot["block_keys"]) == live_keys(events_page(url)["events"])


def test_kv_event_stream_is_gap_free_and_matches_the_snapshot(cluster: SimCluster) -> None:
    url, client = cluster.urls[2], client_for(cluster.urls[2])
    for seed in range(5):
        client.completions.create(model="sim-model", prompt=prompt(10 + seed, 17 + seed), max_tokens=6)
    snapshot = httpx.get(f"{url}/kv/snapshot", headers=ADMIN).json()
    events: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{url}/kv/events", headers=ADMIN, params={"since": 0}, timeout=20) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if events[-1]["seq"] == snapshot["seq"]:
                    break
    assert [e["seq"] for e in events] == list(range(1, snapshot["seq"] + 1))
    assert set(snapshot["block_keys"]) == live_keys(events)
    assert snapshot["namespace"] == {
        "model_name": "sim-model",
        "model_digest": "sim",
        "dtype": "float32",
        "block_size": 4,
        "layout_version": 1,
    }


def test_a_reader_behind_the_retained_events_gets_a_gap() -> None:
    with SimCluster([replace(CONFIG, event_log_capacity=2)]) as sim:
        url, client = sim.urls[0], client_for(sim.urls[0])
        for seed in range(4):
            client.completions.create(model="sim-model", prompt=prompt(20 + seed, 9), max_tokens=1)
        page = events_page(url)
        assert not page["complete"] and page["last_seq"] == 4
        with httpx.stream("GET", f"{url}/kv/events", headers=ADMIN, params={"since": 0}, timeout=20) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[0] == "event: gap"
        assert json.loads(lines[1][5:]) == {"since": 0, "first_available": 3}


# ---------------------------------------------------------------------------- replicas


def test_replicas_in_one_process_are_independent(cluster: SimCluster) -> None:
    tokens = prompt(30, 25)
    before = [events_page(url)["last_seq"] for url in cluster.urls]
    for _ in range(2):
        client_for(cluster.urls[0]).completions.create(model="sim-model", prompt=tokens, max_tokens=2)
    other = client_for(cluster.urls[1]).completions.create(model="sim-model", prompt=tokens, max_tokens=2)
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    after = [events_page(url)["last_seq"] for url in cluster.urls]
    assert after[0] > before[0] and after[1] > before[1] and after[2] == before[2]
    keys = [set(httpx.get(f"{url}/kv/snapshot", headers=ADMIN).json()["block_keys"]) for url in cluster.urls[:2]]
    first_blocks = {k.hex() for k in chain_block_keys(cluster.replicas[0].core.root_key(None), tokens, 4)}
    assert first_blocks <= keys[0] and first_blocks <= keys[1]  # equal keys for equal tokens on every replica


# ---------------------------------------------------------------------------- errors and overload


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "body"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 40000], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2000}, 400, "max_tokens"),  # 501 blocks > 256
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": [1, 2], "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_an_openai_error_and_the_sim_stays_up(
    cluster: SimCluster, path: str, body: Any, status: int, param: str | None
) -> None:
    url = cluster.urls[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if param is not None:
        assert param.split(".")[0] in error["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert ok.status_code == 200


def test_unknown_paths_and_query_values_get_openai_errors(cluster: SimCluster) -> None:
    url = cluster.urls[0]
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    bad_since = httpx.get(f"{url}/kv/events", headers=ADMIN, params={"since": "x"})
    assert bad_since.status_code == 400 and bad_since.json()["error"]["param"] == "since"
    with pytest.raises(openai.NotFoundError):
        client_for(url).completions.create(model="not-this-one", prompt=[1, 2], max_tokens=1)


def test_overload_gets_429_and_a_disconnected_client_frees_its_blocks() -> None:
    config = replace(CONFIG, scheduler=SchedulerConfig(max_num_seqs=1), time_scale=1.0)
    with SimCluster([config], sim_server_options(max_queued_seqs=0)) as sim:
        url = sim.urls[0]
        body = {"prompt": prompt(40, 40), "max_tokens": 900, "stream": True}  # about 30 simulated seconds
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()
            next(lines)
            load = httpx.get(f"{url}/load").json()
            assert set(load) == LOAD_FIELDS
            assert (load["num_running"], load["in_flight_requests"]) == (1, 1) and load["kv_blocks_used"] > 0
            second = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "overloaded"
        wait_for(lambda: httpx.get(f"{url}/load").json()["in_flight_requests"] == 0)
        load = httpx.get(f"{url}/load").json()
        assert (load["num_running"], load["kv_blocks_used"]) == (0, 0)
        assert aborts(url) == 1
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200


def test_a_chat_stream_sends_its_role_chunk_with_its_first_token() -> None:
    """A client that times the first token from the first chunk (vLLM's bench) must not get one before prefill: a
    chat queued behind a running request (one sequence at a time) sends nothing until that request is done."""
    config = replace(CONFIG, scheduler=SchedulerConfig(max_num_seqs=1), time_scale=0.2)
    with SimCluster([config]) as sim:
        url = sim.urls[0]
        running_body = {"prompt": [1, 2, 3], "max_tokens": 120, "ignore_eos": True, "stream": True}
        chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        first_chat_line: list[tuple[float, str]] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=running_body, timeout=30) as running:
            lines = running.iter_lines()
            next(lines)

            def read_chat() -> None:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body, timeout=30) as chat:
                    line = next(line for line in chat.iter_lines() if line)
                    first_chat_line.append((time.monotonic(), line))

            reader = threading.Thread(target=read_chat)
            reader.start()
            wait_for(lambda: httpx.get(f"{url}/load").json()["num_waiting"] == 1)
            assert [line for line in lines if line][-1] == "data: [DONE]"
            running_done = time.monotonic()
        reader.join(timeout=30)
        ((arrived, line),) = first_chat_line
        assert arrived >= running_done and json.loads(line[6:])["choices"][0]["delta"]["role"] == "assistant"


# ---------------------------------------------------------------------------- info, probes, metrics


def test_probe_and_info_endpoints(cluster: SimCluster) -> None:
    url = cluster.urls[0]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = client_for(url).models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    for path in ("/get_model_info", "/model_info"):
        assert httpx.get(f"{url}{path}").json()["model_path"] == "sim-model"
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(f"{url}{path}").json()
        assert (info["page_size"], info["max_total_num_tokens"], info["simulated"]) == (4, 1024, True)
    assert httpx.get(f"{url}/version").json()["version"]
    assert {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(httpx.get(f"{url}/loads").json())
    assert set(httpx.get(f"{url}/load").json()) == LOAD_FIELDS
    assert httpx.post(f"{url}/tokenize", json={"prompt": [5, 6, 7]}).json() == {
        "tokens": [5, 6, 7],
        "count": 3,
        "max_model_len": CONFIG.max_model_len,
    }
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hé"}).json()["tokens"] == [104, 195, 169]
    assert httpx.post(f"{url}/detokenize", json={"tokens": [104, 195, 169]}).json() == {"prompt": "hé"}


def test_metrics_carry_the_replica_metric_names_and_counts() -> None:
    with SimCluster([CONFIG]) as sim:
        url, client = sim.urls[0], client_for(sim.urls[0])
        tokens = prompt(50, 18)
        cached = 0
        for _ in range(3):
            usage = client.completions.create(model="sim-model", prompt=tokens, max_tokens=3).usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached += usage.prompt_tokens_details.cached_tokens or 0
        text = httpx.get(f"{url}/metrics").text
    names = {family.name for family in ServerMetrics("sim-model").registry.collect()}
    for name in names:
        assert f"\n{name}" in text or text.startswith(name) or f"# TYPE {name} " in text, name
    # Every sample names the model the sim serves, as a real replica's do (the sim's own and the KV transfer's).
    models = model_names(text)
    assert {
        "kvyard_requests_total",
        "kvyard_num_requests_running",
        "kvyard_sim_lag_seconds",
        "kvyard_kv_transfer_leased_blocks",
        "kvyard_kv_transfer_pulls_total",
    } <= set(models)
    assert {name: labels for name, labels in models.items() if labels != {"sim-model"}} == {}
    assert metric_value(text, "kvyard_cached_prompt_tokens_total") == cached == 32
    assert metric_value(text, "kvyard_prompt_tokens_total") == 54
    assert metric_value(text, "kvyard_generation_tokens_total") == 9
    assert metric_value(text, "kvyard_time_to_first_token_seconds_count") == 3
    assert metric_value(text, "kvyard_sim_busy_seconds") > 0


# ---------------------------------------------------------------------------- the command


def test_kvyard_sim_command_serves_calibrated_replicas(tmp_path: Path) -> None:
    ports_file = tmp_path / "ports.json"
    calibration = REPO / "benchmarks" / "results" / "offline_throughput.json"
    arguments = [
        "--port",
        "0",
        "--replicas",
        "2",
        "--ports-file",
        str(ports_file),
        "--calibrate",
        str(calibration),
        "--time-scale",
        "0.01",
        "--model-name",
        "m",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvyard", "sim", *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        wait_for(lambda: ports_file.exists() or process.poll() is not None, timeout=60)
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        urls = json.loads(ports_file.read_text())["urls"]
        assert len(urls) == 2
        expected = calibrate_from_json(calibration).cost.to_json()
        for url in urls:
            info = httpx.get(f"{url}/server_info").json()
            assert info["cost_model"] == pytest.approx(expected) and info["time_scale"] == 0.01
            reply = client_for(url).completions.create(model="m", prompt="hello", max_tokens=3)
            assert reply.usage is not None and reply.usage.prompt_tokens == 5
            assert model_names(httpx.get(f"{url}/metrics").text)["kvyard_prompt_tokens_total"] == {"m"}
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_a_non_streaming_client_that_goes_away_frees_its_blocks() -> None:
    with SimCluster([replace(CONFIG, time_scale=1.0)]) as sim:
        url = sim.urls[0]
        body = {"prompt": prompt(60, 30), "max_tokens": 900}  # about 30 simulated seconds
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
        wait_for(lambda: aborts(url) == 1)
        load = httpx.get(f"{url}/load").json()
        assert (load["in_flight_requests"], load["num_running"], load["kv_blocks_used"]) == (0, 0, 0)


def test_chat_without_max_tokens_generates_what_the_cache_holds() -> None:
    with SimCluster([replace(CONFIG, num_kv_blocks=16)]) as sim:
        reply = client_for(sim.urls[0]).chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage is not None
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 64


# ---------------------------------------------------------------------------- fault injection


def test_restart_fails_requests_in_flight_and_forgets_the_cache() -> None:
    with SimCluster([replace(CONFIG, time_scale=1.0)]) as sim:
        url, client = sim.urls[0], client_for(sim.urls[0])
        tokens = prompt(70, 21)
        client.completions.create(model="sim-model", prompt=tokens, max_tokens=1)
        assert events_page(url)["last_seq"] == 1
        body = {"prompt": prompt(71, 30), "max_tokens": 900, "stream": True}
        with (
            httpx.stream("GET", f"{url}/kv/events", headers=ADMIN, params={"since": 0}, timeout=30) as events,
            httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as streaming,
        ):
            lines, event_lines = streaming.iter_lines(), events.iter_lines()
            next(lines)
            assert json.loads(next(event_lines)[5:])["seq"] == 1
            assert httpx.post(f"{url}/sim/restart", headers=ADMIN).json() == {"status": "restarted"}
            rest = [line for line in lines if line]
            # The event stream ends (it would otherwise time out) after the events of the old cache.
            old = [json.loads(line[5:])["seq"] for line in event_lines if line.startswith("data:")]
            assert old == list(range(2, 2 + len(old)))
        assert "replica_restarted" in rest[-1] and "[DONE]" not in rest[-1]
        assert events_page(url) == {"events": [], "complete": True, "last_seq": 0}
        assert httpx.get(f"{url}/kv/snapshot", headers=ADMIN).json()["block_keys"] == []
        again = client.completions.create(model="sim-model", prompt=tokens, max_tokens=1)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert metric_value(httpx.get(f"{url}/metrics").text, "kvyard_prompt_tokens_total") == 21


def test_an_unhealthy_replica_answers_503_until_healed(cluster: SimCluster) -> None:
    url = cluster.urls[2]
    assert httpx.post(f"{url}/sim/health", headers=ADMIN, json={"healthy": "no"}).status_code == 400
    assert httpx.post(f"{url}/sim/health", headers=ADMIN, json={"healthy": False}).json() == {"healthy": False}
    try:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unhealthy"
    finally:
        httpx.post(f"{url}/sim/health", headers=ADMIN, json={"healthy": True})
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_tokenize_ignores_other_engines_options(cluster: SimCluster) -> None:
    body = {"model": "sim-model", "prompt": "ab", "add_special_tokens": True, "return_token_strs": True}
    assert httpx.post(f"{cluster.urls[0]}/tokenize", json=body).json()["tokens"] == [97, 98]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [(["--calibrate", "/nonexistent.json"], "cannot read benchmark JSON"), (["--time-scale", "0"], "time_scale")],
)
def test_kvyard_sim_rejects_bad_arguments(arguments: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvyard", "sim", "--port", "0", *arguments], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and message in result.stderr


def test_unknown_fields_are_ignored_and_named_in_a_header(
    cluster: SimCluster, caplog: pytest.LogCaptureFixture
) -> None:
    url = cluster.urls[0]
    extra = {"no_stop_trim": True, "metadata": {"k": "v"}, "store": False, "reasoning_effort": "low", "a\r\nX-Evil": 1}
    with caplog.at_level("WARNING", logger="kvyard.server.app"):
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **extra})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
    named = "metadata, no_stop_trim, reasoning_effort, store, ..."  # the name that could break a header is left out
    assert completion.headers["x-kvyard-ignored-fields"] == named and "x-evil" not in completion.headers
    assert any(named in record.getMessage() for record in caplog.records)
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True, "store": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body) as chat:
        assert chat.status_code == 200 and chat.headers["x-kvyard-ignored-fields"] == "store"
        assert [line for line in chat.iter_lines() if line][-1] == "data: [DONE]"
    wrong_type = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": "2", "store": True})
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "max_tokens"  # known: strict
    known = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
    assert "x-kvyard-ignored-fields" not in known.headers
    schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    assert schema["additionalProperties"] is True


def test_reject_unknown_fields_restores_the_strict_rule() -> None:
    with SimCluster([CONFIG], replace(sim_server_options(), reject_unknown_fields=True)) as sim:
        url = sim.urls[0]
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "store": False})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
        tokenize = httpx.post(f"{url}/tokenize", json={"prompt": "ab", "return_token_strs": True})
        assert tokenize.status_code == 400 and tokenize.json()["error"]["param"] == "return_token_strs"
        schema = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
        assert schema["additionalProperties"] is False


def test_a_second_stop_signal_ends_the_server_at_once(tmp_path: Path) -> None:
    """The first SIGTERM lets a running stream finish (grace 60 s); a second one stops the server at once."""
    ports_file = tmp_path / "ports.json"
    arguments = ["--port", "0", "--ports-file", str(ports_file), "--time-scale", "1.0", "--shutdown-grace-s", "60"]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvyard", "sim", *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: ports_file.exists() or process.poll() is not None, timeout=60)
        url = json.loads(ports_file.read_text())["urls"][0]
        body = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True}  # about 30 s
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            process.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert process.poll() is None and next(lines) is not None  # still streaming, within its grace
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
            rest: list[str] = []
            with contextlib.suppress(httpx.HTTPError):
                rest.extend(lines)
            assert "data: [DONE]" not in rest  # cut off, not finished
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read() if process.stdout else ""
    assert "second signal: stopping now" in output

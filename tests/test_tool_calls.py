"""Tool calling: the parsers read calls out of model text (whole and streamed piece by piece); through a real
server and the official `openai` client, `required` and named calls are valid for a random-weight model, and a
round trip (tools → tool_calls → tool message → answer) renders through the chat template."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_utils import ServerProcess

from kvyard.server.tool_calls import HermesParser, Llama3JsonParser, ToolPlan, ToolStream

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}

# ---------------------------------------------------------------------------- parsers

HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def test_hermes_parser_reads_content_and_every_call() -> None:
    parser = HermesParser()
    calls = parser.calls(HERMES_TEXT, finished=True)
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert HERMES_TEXT[: parser.content_end(HERMES_TEXT, True)] == "Let me check. "
    unclosed = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'  # the model stopped before the tag
    assert parser.calls(unclosed, finished=False) == []
    finished = parser.calls(unclosed, finished=True)
    assert finished is not None and finished[0].name == "get_time"
    assert parser.calls("<tool_call>{not json}</tool_call>", finished=True) is None
    assert parser.calls("no calls at all", finished=True) == []


def test_llama3_json_parser_reads_one_or_several_objects() -> None:
    parser = Llama3JsonParser()
    single = parser.calls('{"name": "get_time", "parameters": {"zone": "PST"}}', finished=True)
    assert single is not None and [(c.name, json.loads(c.arguments)) for c in single] == [("get_time", {"zone": "PST"})]
    several = parser.calls(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', finished=True
    )
    assert several is not None and [c.name for c in several] == ["a", "b"]
    assert json.loads(several[1].arguments) == {"x": 1}
    assert parser.calls("Hello there", finished=True) == []
    assert parser.content_end('{"name"', finished=False) == 0  # a call being written is not content
    assert parser.calls('{"name": "a", "parameters": {', finished=True) is None


def _stream(plan: ToolPlan, text: str, step: int) -> tuple[str, list[dict[str, Any]], list[str | None]]:
    """Feed `text` to a ToolStream `step` characters at a time, as a streamed choice would."""
    stream, sent, content, deltas = ToolStream(plan), 0, "", []
    for end in range(step, len(text) + step, step):
        delta, sent = stream.delta(text[:end], sent, finished=end >= len(text))
        content += delta.get("content", "")
        deltas += delta.get("tool_calls", [])
    return content, deltas, [call.id for call in stream.sent_calls]


@pytest.mark.parametrize("step", [1, 3, 17])
def test_streamed_hermes_calls_arrive_whole_once_each_and_content_never_leaks_a_tag(step: int) -> None:
    content, deltas, ids = _stream(ToolPlan("auto", HermesParser()), HERMES_TEXT, step)
    assert content == "Let me check. "
    assert [d["index"] for d in deltas] == [0, 1] and [d["id"] for d in deltas] == ids
    assert [d["function"]["name"] for d in deltas] == ["get_weather", "get_time"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"zone": "CET"}
    plain, none, _ = _stream(ToolPlan("auto", HermesParser()), "a <tool_cal is not a tag", step)
    assert plain == "a <tool_cal is not a tag" and none == []


def test_a_named_call_streams_its_arguments_as_they_are_generated() -> None:
    arguments = '{"city": "Lima", "unit": "celsius"}'
    content, deltas, _ = _stream(ToolPlan("named", HermesParser(), "get_weather"), arguments, 5)
    assert content == "" and deltas[0]["function"]["name"] == "get_weather" and "id" in deltas[0]
    assert "".join(d["function"]["arguments"] for d in deltas) == arguments
    assert all("id" not in d for d in deltas[1:])


# ---------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server(llama_server: ServerProcess) -> ServerProcess:
    return llama_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)


USER: Any = {"role": "user", "content": "What is the weather in Oslo?"}


def _assert_valid_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="tiny-llama", messages=[USER], tools=TOOLS, tool_choice="required", seed=2, max_tokens=300
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    _assert_valid_calls(choice.message.tool_calls)
    call = choice.message.tool_calls[0]
    history: Any = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 7, "sky": "rain"}'},
    ]
    answer = client.chat.completions.create(
        model="tiny-llama", messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason in ("stop", "length")
    assert first.usage is not None and answer.usage is not None
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_streamed_required_and_named_calls(client: openai.OpenAI) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=[USER],
            tools=TOOLS,
            seed=5,
            tool_choice=tool_choice,
            max_tokens=300,
            stream=True,
        )  # type: ignore[arg-type]
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            if not chunk.choices:
                continue
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        for entry in calls.values():
            assert entry["id"].startswith("call_")
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
        if isinstance(tool_choice, dict):
            assert [entry["name"] for entry in calls.values()] == ["get_time"]
    # the round trip's second half, streamed: the calls and their results go back, an answer streams out
    history: Any = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": entry["id"],
                    "type": "function",
                    "function": {"name": entry["name"], "arguments": entry["arguments"]},
                }
                for entry in calls.values()
            ],
        },
    ]
    history += [{"role": "tool", "tool_call_id": entry["id"], "content": "done"} for entry in calls.values()]
    answer = client.chat.completions.create(
        model="tiny-llama", messages=history, tools=TOOLS, max_tokens=6, temperature=0, stream=True
    )
    chunks = [chunk for chunk in answer if chunk.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"  # six tokens of a random model's answer, no call
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


def test_named_call_and_parallel_calls_off(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model="tiny-llama",
        messages=[USER],
        tools=TOOLS,
        seed=1,
        max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    calls = named.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]
    _assert_valid_calls(calls)
    for seed in range(6):
        single = client.chat.completions.create(
            model="tiny-llama",
            messages=[USER],
            tools=TOOLS,
            seed=seed,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
        )
        assert single.choices[0].message.tool_calls is not None and len(single.choices[0].message.tool_calls) == 1


def test_auto_renders_the_tools_and_returns_plain_text_without_calls(client: openai.OpenAI) -> None:
    with_tools = client.chat.completions.create(
        model="tiny-llama", messages=[USER], tools=TOOLS, max_tokens=4, temperature=0
    )
    without = client.chat.completions.create(model="tiny-llama", messages=[USER], max_tokens=4, temperature=0)
    none = client.chat.completions.create(
        model="tiny-llama", messages=[USER], tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert with_tools.usage and without.usage and none.usage
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens == none.usage.prompt_tokens
    assert with_tools.choices[0].message.tool_calls is None and with_tools.choices[0].finish_reason == "length"
    # /tokenize renders the tools as the chat does (the router hashes that prompt's blocks to route)
    url = str(client.base_url).removesuffix("/v1/")
    counted = httpx.post(f"{url}/tokenize", json={"messages": [USER], "tools": TOOLS}, timeout=30).json()["count"]
    assert counted == with_tools.usage.prompt_tokens


def test_tools_with_response_format_as_vllm_serves_them(client: openai.OpenAI) -> None:
    """A required call's schema replaces response_format; under auto, response_format constrains the answer."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    required = client.chat.completions.create(
        model="tiny-llama",
        messages=[USER],
        tools=TOOLS,
        seed=5,
        tool_choice="required",
        response_format=response_format,
        max_tokens=300,
    )
    calls = required.choices[0].message.tool_calls or []
    assert calls and required.choices[0].finish_reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])  # type: ignore[union-attr]
    auto = client.chat.completions.create(
        model="tiny-llama", messages=[USER], tools=TOOLS, seed=5, response_format=response_format, max_tokens=100
    )
    assert auto.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(auto.choices[0].message.content or ""), schema)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_requests_get_a_400_naming_the_field(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    request = {"model": "tiny-llama", "messages": [USER], "stream": True, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param

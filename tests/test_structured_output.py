"""Constrained decoding: outputs that must be JSON (any object, or matching a schema), match a regex, pick one
of a set of strings or follow a Lark grammar do so, with a random-weight model, sampled and greedy, batched
with unconstrained requests, through the engine and through a real server with the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_utils import ServerProcess

from kvyard import LLM, SamplingParams
from kvyard.engine.sampling.structured_output import StructuredOutput
from kvyard.engine.speculative.policy import SpeculativeConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "member", "role", "tags"],
    "additionalProperties": False,
}


def constrained(structured: StructuredOutput, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 400), structured=structured, **kwargs)


# ---------------------------------------------------------------------------- engine


def test_sampled_json_schema_outputs_are_valid_and_end_when_the_object_closes(llama_dir: Path) -> None:
    params = [constrained(StructuredOutput.json_schema(PERSON), temperature=1.0, seed=seed) for seed in range(16)]
    outputs = LLM(str(llama_dir)).generate(["A person as JSON: "] * len(params), params)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), PERSON)
        assert output.text.rstrip().endswith("}")


def test_an_object_schema_that_does_not_say_takes_no_other_keys(llama_dir: Path) -> None:
    """A schema without `additionalProperties` (instructor's, LangChain's non-strict ones) is read as vLLM's default
    backend reads it: no keys beyond `properties`, so a model cannot pad the object until max_tokens."""
    nested = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    properties = {key: value for key, value in PERSON["properties"].items() if key != "tags"}
    open_person = {"type": "object", "properties": {**properties, "home": nested}, "required": ["name", "home"]}
    params = [constrained(StructuredOutput.json_schema(open_person), temperature=1.0, seed=seed) for seed in range(16)]
    outputs = LLM(str(llama_dir)).generate(["A person as JSON: "] * len(params), params)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        person = json.loads(output.text)
        assert set(person) <= set(open_person["properties"]) and set(person["home"]) == {"city"}, output.text


def test_regex_choice_and_lark_grammar_constrain_the_output(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    regex = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")
    choice = StructuredOutput.choice(["yes", "no", "it depends (maybe)"])
    lark = StructuredOutput("grammar", 'start: "(" item (" + " item)* ")"\nitem: /[0-9]{1,2}/')
    prompts = ["Answer: "] * 12
    params = [constrained(s, temperature=1.0, seed=i) for i in range(4) for s in (regex, choice, lark)]
    outputs = llm.generate(prompts, params)
    for output, param in zip(outputs, params):
        assert output.finish_reason == "stop"
        assert param.structured is not None
        if param.structured.kind == "regex":
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", output.text), output.text
        elif param.structured.kind == "choice":
            assert output.text in {"yes", "no", "it depends (maybe)"}
        else:
            assert re.fullmatch(r"\([0-9]{1,2}( \+ [0-9]{1,2})*\)", output.text), output.text


def test_constrained_and_free_requests_share_a_batch_without_changing_each_other(llama_dir: Path) -> None:
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    json_greedy = constrained(StructuredOutput("json_object"), temperature=0)
    llm = LLM(str(llama_dir))
    as_json = "Write the answer as one JSON object, with keys and values of your choice: " * 2  # > 2 blocks
    alone_free = llm.generate(["The weather"], free)[0].token_ids
    alone_json = llm.generate([as_json], json_greedy)[0]
    mixed = llm.generate(["The weather", as_json, "The weather"], [free, json_greedy, free])
    assert mixed[0].token_ids == mixed[2].token_ids == alone_free
    assert mixed[1].token_ids == alone_json.token_ids
    if alone_json.finish_reason == "stop":
        assert isinstance(json.loads(alone_json.text), dict)
    again = llm.generate([as_json], json_greedy)[0]  # from the prefix cache
    assert again.token_ids == alone_json.token_ids and again.num_cached_tokens > 0


def test_a_constrained_request_on_a_speculating_engine_gives_the_same_output(llama_dir: Path) -> None:
    params = [constrained(StructuredOutput.json_schema(PERSON), temperature=0.8, seed=s) for s in range(4)]
    prompts = ["x y x y x y x y"] * len(params)
    reference = [o.token_ids for o in LLM(str(llama_dir)).generate(prompts, params)]
    with LLM(str(llama_dir), speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (StructuredOutput.json_schema({"type": "strin"}), "strin"),
        (StructuredOutput("regex", "[a-"), "response_format"),
        (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
        (StructuredOutput("json_schema", "{not json"), "response_format"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_by_name(
    llama_dir: Path, structured: StructuredOutput, message: str
) -> None:
    with LLM(str(llama_dir)) as llm:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate(["x"], constrained(structured))
        assert llm.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids  # still serving


# ---------------------------------------------------------------------------- server, openai client


@pytest.fixture(scope="module")
def server(llama_server: ServerProcess) -> ServerProcess:
    return llama_server


def test_fifty_seeded_strict_json_schema_chats_are_all_valid(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def one(seed: int) -> Any:
        return await client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": f"Describe person {seed} as JSON."}],
            response_format=response_format,
            seed=seed,
            temperature=1.0,
            max_tokens=400,
        )

    async def run_all() -> list[Any]:
        return await asyncio.gather(*(one(seed) for seed in range(50)))

    results = asyncio.run(run_all())
    for result in results:
        choice = result.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_schema_chat_equals_the_whole_answer_and_structured_outputs_work(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test", max_retries=0)
    request: Any = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "JSON please"}],
        "seed": 3,
        "max_tokens": 400,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    }
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    whole = client.chat.completions.create(**request).choices[0]
    assert finish == whole.finish_reason == "stop" and "".join(pieces) == whole.message.content
    jsonschema.validate(json.loads("".join(pieces)), PERSON)
    picked = client.completions.create(
        model="tiny-llama",
        prompt="Pick one:",
        max_tokens=20,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert picked.choices[0].text in {"red", "green", "blue"}
    guided = client.completions.create(
        model="tiny-llama",
        prompt="Pick one:",
        max_tokens=20,
        seed=1,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )  # vLLM's older name
    assert guided.choices[0].text == picked.choices[0].text


def test_json_object_outputs_that_end_are_json_objects(llama_dir: Path) -> None:
    """Any JSON object has no bound on its length: a random model may run to max_tokens inside a string (the
    answer then says `length`); every output that ends by itself is one complete object."""
    params = [
        constrained(StructuredOutput("json_object"), temperature=1.0, seed=seed, max_tokens=400) for seed in range(12)
    ]
    outputs = LLM(str(llama_dir)).generate(["JSON please"] * len(params), params)
    ended = [output for output in outputs if output.finish_reason == "stop"]
    assert len(ended) >= 3  # not vacuous
    for output in ended:
        assert isinstance(json.loads(output.text), dict)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
        ({"guided_regex": "[a-"}, "structured_outputs"),
    ],
)
def test_bad_constraints_get_a_400_naming_the_field_before_any_stream(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    request = {"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stream": True, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200

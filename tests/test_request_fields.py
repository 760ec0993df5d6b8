"""vLLM's request fields that kvyard implements on `/v1/completions` and `/v1/chat/completions` (docs/openai-api.md):
`skip_special_tokens`, `bad_words`, `truncate_prompt_tokens`, `continue_final_message`, `prompt_logprobs` and
`priority`, on a real `kvyard serve` of the tiny Llama model, greedy, compared token for token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import ServerProcess
from transformers import AutoTokenizer

from kvyard import LLM, SamplingParams
from kvyard.engine.sampling.bad_words import bad_words_token_ids

GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Write a haiku about caches."}, {"role": "assistant", "content": "Blocks of"}]


@pytest.fixture(scope="module")
def server(llama_server: ServerProcess) -> ServerProcess:
    return llama_server


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_dir)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _ok(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    assert "x-kvyard-ignored-fields" not in response.headers
    answer: dict[str, Any] = response.json()
    return answer


def _refused(server: ServerProcess, path: str, body: dict[str, Any]) -> str:
    """The field a 400 names."""
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    param: str = response.json()["error"]["param"]
    return param


def _generated(server: ServerProcess, path: str, body: dict[str, Any]) -> tuple[list[int], str]:
    """The token ids a request generates (from the progress lines of its stream, kvyard's router extension) and
    its text."""
    token_ids: list[int] = []
    text = ""
    stream_body = {**body, "stream": True, "stream_progress": True}
    with httpx.stream("POST", f"{server.url}{path}", json=stream_body, timeout=60) as response:
        assert response.status_code == 200 and "x-kvyard-ignored-fields" not in response.headers
        for line in response.iter_lines():
            if line.startswith(": progress "):
                ids = line.split(" ")[3] if len(line.split(" ")) > 3 else ""
                token_ids += [int(token_id) for token_id in ids.split(",") if token_id]
            elif line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return token_ids, text


def _tokenize(server: ServerProcess, body: dict[str, Any]) -> list[int]:
    tokens: list[int] = _ok(server, "/tokenize", body)["tokens"]
    return tokens


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    text: str = choice["text"] if "text" in choice else choice["message"]["content"]
    return text


# ---------------------------------------------------------------------------- skip_special_tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_special_tokens_appear_in_the_text_when_not_skipped(server: ServerProcess, tokenizer: Any, path: str) -> None:
    header = tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    body = {"max_tokens": 3, "logit_bias": {str(header): 100}, **GREEDY}
    body |= {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": MESSAGES[:1]}
    skipped_ids, skipped = _generated(server, path, body)
    kept_ids, kept = _generated(server, path, {**body, "skip_special_tokens": False})
    assert skipped_ids == kept_ids == [header] * 3
    assert skipped == "" and kept == "<|start_header_id|>" * 3
    assert _text(_ok(server, path, {**body, "skip_special_tokens": False})) == kept


# ---------------------------------------------------------------------------- bad_words


def _words(tokenizer: Any, generated: list[int], length: int) -> list[tuple[int, str, list[tuple[int, ...]]]]:
    """(position, word, its token sequences) for each `length`-token word of `generated` that bad_words would
    tokenize to those very tokens."""
    found = []
    for start in range(len(generated) - length + 1):
        word = tokenizer.decode(generated[start : start + length])
        if "\ufffd" in word or not word.strip():
            continue
        sequences = bad_words_token_ids([word], tokenizer, len(tokenizer))
        if tuple(generated[start : start + length]) in sequences:
            found.append((start, word, sequences))
    return found


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_one_token_bad_word_is_never_generated(server: ServerProcess, tokenizer: Any, path: str) -> None:
    body = {"max_tokens": 24, **GREEDY}
    body |= {"prompt": "def fibonacci(n):"} if path == "/v1/completions" else {"messages": MESSAGES[:1]}
    plain, _ = _generated(server, path, body)
    words = _words(tokenizer, plain, 1)
    assert words, f"no one-token word in {plain}"
    _, word, sequences = words[0]
    banned = {token_id for sequence in sequences for token_id in sequence}
    without, text = _generated(server, path, {**body, "bad_words": [word]})
    assert not banned & set(without) and without != plain
    # the rest is what the model generates with the word's tokens banned
    biased, _ = _generated(server, path, {**body, "logit_bias": {str(token_id): -100 for token_id in banned}})
    assert without == biased
    assert _text(_ok(server, path, {**body, "bad_words": [word]})) == text


def test_a_bad_word_of_two_tokens_is_cut_before_its_last_token(server: ServerProcess, tokenizer: Any) -> None:
    body = {"prompt": "def fibonacci(n):", "max_tokens": 32, **GREEDY}
    plain, _ = _generated(server, "/v1/completions", body)
    words = _words(tokenizer, plain, 2)
    assert words, f"no two-token word in {plain}"
    start, word, sequences = words[0]
    without, _ = _generated(server, "/v1/completions", {**body, "bad_words": [word]})
    assert without[: start + 1] == plain[: start + 1] and without[start + 1] != plain[start + 1]
    for sequence in sequences:
        assert all(tuple(without[i : i + len(sequence)]) != sequence for i in range(len(without)))


def test_a_bad_word_without_tokens_is_refused(server: ServerProcess) -> None:
    assert _refused(server, "/v1/completions", {"prompt": "a", "bad_words": ["  "]}) == "bad_words"
    assert _refused(server, "/v1/completions", {"prompt": "a", "bad_words": "word", "stream": True}) == "bad_words"


# ---------------------------------------------------------------------------- truncate_prompt_tokens


def test_truncated_prompts_keep_their_last_tokens(server: ServerProcess) -> None:
    prompt = "The history of caching in serving systems is long and full of surprises"
    prompt_ids = _tokenize(server, {"prompt": prompt, "add_special_tokens": True})
    body = {"prompt": prompt, "max_tokens": 12, "truncate_prompt_tokens": 5, **GREEDY}
    answer = _ok(server, "/v1/completions", body)
    assert answer["usage"]["prompt_tokens"] == 5 < len(prompt_ids)
    direct = {**body, "prompt": prompt_ids[-5:], "truncate_prompt_tokens": None}
    assert _generated(server, "/v1/completions", body) == _generated(server, "/v1/completions", direct)
    echoed = _ok(server, "/v1/completions", {**body, "echo": True})["choices"][0]["text"]
    assert echoed == _ok(server, "/v1/completions", {**direct, "echo": True})["choices"][0]["text"]

    chat = {"messages": MESSAGES[:1], "max_tokens": 12, "truncate_prompt_tokens": 6, **GREEDY}
    rendered = _tokenize(server, {"messages": MESSAGES[:1]})
    assert _ok(server, "/v1/chat/completions", chat)["usage"]["prompt_tokens"] == 6
    assert (
        _generated(server, "/v1/chat/completions", chat)[0]
        == _generated(server, "/v1/completions", {"prompt": rendered[-6:], "max_tokens": 12, **GREEDY})[0]
    )


def test_truncation_to_the_context_and_bad_truncations(server: ServerProcess) -> None:
    max_model_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    long_prompt = [5 + i % 900 for i in range(max_model_len + 100)]
    body = {"prompt": long_prompt, "max_tokens": 8, "truncate_prompt_tokens": -1, **GREEDY}
    assert _ok(server, "/v1/completions", body)["usage"]["prompt_tokens"] == max_model_len - 8
    for value in (0, -2, max_model_len - 7, "5", 1.5):
        refused = _refused(server, "/v1/completions", {**body, "truncate_prompt_tokens": value})
        assert refused == "truncate_prompt_tokens"


# ---------------------------------------------------------------------------- continue_final_message


def test_continue_final_message_continues_the_assistant_text(server: ServerProcess, tokenizer: Any) -> None:
    rendered = _tokenize(server, {"messages": MESSAGES, "add_generation_prompt": False})
    assert rendered[-1] == tokenizer.convert_tokens_to_ids("<|eot_id|>")  # the end of the assistant's turn
    body = {"messages": MESSAGES, "max_tokens": 12, "continue_final_message": True, **GREEDY}
    continued, text = _generated(server, "/v1/chat/completions", body)
    direct = {"prompt": rendered[:-1], "max_tokens": 12, **GREEDY}
    assert (continued, text) == _generated(server, "/v1/completions", direct)
    assert _ok(server, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == len(rendered) - 1
    # a new turn otherwise: the generation prompt after the end of the assistant's
    assert _generated(server, "/v1/chat/completions", {**body, "continue_final_message": False})[0] != continued
    assert _generated(server, "/v1/chat/completions", {**body, "add_generation_prompt": False})[0] == continued
    both = {**body, "add_generation_prompt": True}
    assert _refused(server, "/v1/chat/completions", both) == "continue_final_message"
    assert _refused(server, "/v1/chat/completions", {**body, "continue_final_message": 1}) == "continue_final_message"


# ---------------------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_are_the_echoed_prompts_in_vllms_shape(server: ServerProcess, tokenizer: Any) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    prompt_ids = _tokenize(server, {"prompt": prompt, "add_special_tokens": True})
    body = {"prompt": prompt, "max_tokens": 2, **GREEDY}
    echoed = _ok(server, "/v1/completions", {**body, "echo": True, "logprobs": 2})["choices"][0]["logprobs"]
    choice = _ok(server, "/v1/completions", {**body, "prompt_logprobs": 2})["choices"][0]
    assert "prompt_logprobs" not in _ok(server, "/v1/completions", body)["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) and scored[0] is None and echoed["token_logprobs"][0] is None
    for position, entry in enumerate(scored[1:], start=1):
        token_id = prompt_ids[position]
        own = entry[str(token_id)]
        assert next(iter(entry)) == str(token_id)  # the prompt token first, then the most likely ones
        assert own["logprob"] == echoed["token_logprobs"][position]
        assert own["decoded_token"] == tokenizer.decode([token_id])
        likeliest = sorted((value for value in entry.values() if value["rank"] <= 2), key=lambda v: v["rank"])
        assert [value["rank"] for value in likeliest] == [1, 2]
        assert len(entry) == (2 if own["rank"] <= 2 else 3)
        assert {value["decoded_token"]: value["logprob"] for value in likeliest} == echoed["top_logprobs"][position]
    # echo with fewer alternatives keeps its own count; prompt_logprobs its own
    both = _ok(server, "/v1/completions", {**body, "echo": True, "logprobs": 1, "prompt_logprobs": 3})["choices"][0]
    assert all(len(top) == 1 for top in both["logprobs"]["top_logprobs"][1 : len(prompt_ids)])
    assert all(3 <= len(entry) <= 4 for entry in both["prompt_logprobs"][1:])

    chat = _ok(
        server, "/v1/chat/completions", {"messages": MESSAGES[:1], "max_tokens": 2, "prompt_logprobs": 0, **GREEDY}
    )
    rendered = _tokenize(server, {"messages": MESSAGES[:1]})
    keys = [None if entry is None else list(entry) for entry in chat["prompt_logprobs"]]
    assert keys == [None, *[[str(token_id)] for token_id in rendered[1:]]]
    assert "prompt_logprobs" not in chat["choices"][0]


def test_prompt_logprobs_are_refused_with_a_stream_or_too_many(server: ServerProcess) -> None:
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        assert _refused(server, path, {**body, "prompt_logprobs": 1, "stream": True}) == "prompt_logprobs"
        assert _refused(server, path, {**body, "prompt_logprobs": 21}) == "prompt_logprobs"
        assert _refused(server, path, {**body, "prompt_logprobs": "1"}) == "prompt_logprobs"


# ---------------------------------------------------------------------------- priority


def test_a_priority_needs_the_priority_policy(server: ServerProcess, llama_dir: Path) -> None:
    for stream in (False, True):
        body = {"max_tokens": 2, "priority": -1, "stream": stream}
        assert _refused(server, "/v1/completions", {**body, "prompt": "a"}) == "priority"
        assert _refused(server, "/v1/chat/completions", {**body, "messages": MESSAGES}) == "priority"
    assert _refused(server, "/v1/completions", {"prompt": "a", "priority": 1.5}) == "priority"
    _ok(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "priority": 0})
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, priority=p) for p in (3, -3)]
    with LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1) as llm:
        outputs = llm.generate(["first", "second"], params)  # one at a time: the urgent second one goes first
        assert [len(output.token_ids) for output in outputs] == [4, 4]
        lax, urgent = (output.times for output in outputs)
        assert lax is not None and lax.first_token is not None and urgent is not None and urgent.finished is not None
        assert urgent.finished <= lax.first_token
    with LLM(str(llama_dir)) as llm, pytest.raises(ValueError, match="priority"):
        llm.generate(["a"], params[0])

"""--reasoning-parser: a reasoning model's thinking goes in reasoning_content, whole and streamed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvyard.server.reasoning import ReasoningParser, ReasoningStream
from tests.server_utils import ServerProcess, start_server

QWEN3 = ReasoningParser.named("qwen3")
R1 = ReasoningParser.named("deepseek_r1")


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (QWEN3, "<think>\nweigh it</think>\n\nYes.", "\nweigh it", "\n\nYes."),
        (QWEN3, "Yes, no thinking.", "", "Yes, no thinking."),  # enable_thinking off
        (QWEN3, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
        (R1, "weigh it</think>Yes.", "weigh it", "Yes."),  # the template opened <think>
        (R1, "<think>weigh it</think>Yes.", "weigh it", "Yes."),
        (R1, "still thinking", "still thinking", ""),
    ],
)
def test_an_answer_splits_into_reasoning_and_content(
    parser: ReasoningParser, text: str, reasoning: str, content: str
) -> None:
    split = parser.split(text, finished=True)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("parser", [QWEN3, R1])
@pytest.mark.parametrize("text", ["<think>a < b, so </think>b wins</think>?", "<think>x</think>", "plain"])
def test_streamed_one_character_at_a_time_it_adds_up_to_the_whole_and_never_shows_a_tag(
    parser: ReasoningParser, text: str
) -> None:
    stream, sent_content, reasoning = ReasoningStream(parser), 0, ""
    content = ""
    for end in range(1, len(text) + 1):
        delta, split = stream.delta(text[:end], finished=end == len(text))
        reasoning += delta
        content += split.content[sent_content:]
        sent_content = len(split.content)
        assert "<think>" not in delta and "</think" not in delta
    whole = parser.split(text, finished=True)
    assert (reasoning, content) == (whole.reasoning, whole.content)


def test_an_unknown_parser_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        ReasoningParser.named("o1")


@pytest.fixture(scope="module")
def qwen3_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(
        llama_dir,
        tmp_path_factory.mktemp("reasoning"),
        "--served-model-name",
        "tiny-llama",
        "--reasoning-parser",
        "qwen3",
    )
    yield process
    process.stop()


def chat(url: str, stream: bool) -> httpx.Response:
    """A greedy answer forced (by a regex) into a reasoning model's shape."""
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "think first"}],
        "max_tokens": 48,
        "temperature": 0,
        "guided_regex": "<think>[a-z]{4,10}</think>[a-z]{2,6}",
        "stream": stream,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_the_server_puts_the_thinking_in_reasoning_content_whole_and_streamed(qwen3_server: ServerProcess) -> None:
    whole = chat(qwen3_server.url, stream=False)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert re.fullmatch(r"[a-z]{4,10}", message["reasoning_content"]), message
    assert re.fullmatch(r"[a-z]{2,6}", message["content"]), message
    streamed = chat(qwen3_server.url, stream=True)
    deltas = [json.loads(line[6:])["choices"] for line in streamed.text.splitlines() if line.startswith("data: {")]
    pieces = [choice[0]["delta"] for choice in deltas if choice]
    assert "".join(d.get("reasoning_content") or "" for d in pieces) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in pieces) == message["content"]
    assert not any("think>" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in pieces)

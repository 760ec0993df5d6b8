"""Incremental detokenization and stop strings, with the byte-level BPE tokenizer of a real tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvyard.engine.sampling.detokenizer import IncrementalDetokenizer
from kvyard.testing.create_model import create_model

TEXTS = [
    "héllo wörld — 你好 🙂",
    "Hello, world! return value",
    "def __init__(self):\n    return {'ключ': 'значение'}\n",
    "日本語のテキスト、そして한국어",
    "emoji 🙂🙃👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "  leading spaces\n\n\ttabs and trailing   ",
    "é",
]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    model_dir: Path = create_model("llama", "tiny", tmp_path_factory.mktemp("detok-llama"))
    return AutoTokenizer.from_pretrained(model_dir)


def encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips exactly
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], int | None, str | None]:
    """Push ids until a stop string matches; returns (deltas, index of the stopping push, stop)."""
    deltas = []
    for index, token_id in enumerate(ids):
        delta, stop = detok.push(token_id)
        deltas.append(delta)
        if stop is not None:
            return deltas, index, stop
    return deltas, None, None


def first_push_showing(tokenizer: Any, ids: list[int], needle: str) -> int:
    return next(k for k in range(len(ids)) if needle in tokenizer.decode(ids[: k + 1]))


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for count, token_id in enumerate(ids, start=1):
        delta, stop = detok.push(token_id)
        assert stop is None
        assert "\ufffd" not in delta, "a partial UTF-8 character leaked out"
        deltas.append(delta)
        assert detok.text == "".join(deltas)
        decoded = tokenizer.decode(ids[:count], skip_special_tokens=True)
        assert decoded.startswith(detok.text)
        if not decoded.endswith("\ufffd"):
            # Nothing is held back once the text so far is complete.
            assert detok.text == decoded
    tail = detok.finish()
    assert tail == ""
    assert detok.text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = [tokenizer.bos_token_id, *encode(tokenizer, "héllo"), tokenizer.eos_token_id]
    ids += [*encode(tokenizer, " wörld 🙂"), tokenizer.pad_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _, _ = stream(detok, ids)
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=True) == "héllo wörld 🙂"


def test_special_tokens_are_kept_when_not_skipped(tokenizer: Any) -> None:
    ids = [tokenizer.bos_token_id, *encode(tokenizer, "héllo"), tokenizer.eos_token_id]
    ids += [*encode(tokenizer, " wörld 🙂"), tokenizer.pad_token_id]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    deltas, _, _ = stream(detok, ids)
    deltas.append(detok.finish())
    expected = tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(deltas) == detok.text == expected != tokenizer.decode(ids, skip_special_tokens=True)
    assert expected.startswith(tokenizer.bos_token) and tokenizer.eos_token in expected


def test_incomplete_character_at_the_end_is_flushed_by_finish(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ab 你好")
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _, _ = stream(detok, ids[:-1])
    assert detok.text == "ab 你"  # the half of 好 is held back
    tail = detok.finish()
    expected = tokenizer.decode(ids[:-1], skip_special_tokens=True)
    assert expected.endswith("\ufffd")
    assert "".join(deltas) + tail == detok.text == expected


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_token_ids_match_full_decode(tokenizer: Any, data: st.DataObject) -> None:
    # Random-weight models emit arbitrary ids: byte fragments, invalid UTF-8, special tokens.
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=30))
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _, _ = stream(detok, ids)
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    ("text", "stop", "before", "through"),
    [
        ("Hello, world! return value", "world", "Hello, ", "Hello, world"),
        ("Hello, world! return value", "Hello", "", "Hello"),
        ("Hello, world! return value", " value", "Hello, world! return", "Hello, world! return value"),
        # Spans five tokens: 'l', 'lo', ' w' and the two byte tokens of 'ö'.
        ("héllo wörld — 你好 🙂", "llo wö", "hé", "héllo wö"),
        # Spans six byte tokens.
        ("héllo wörld — 你好 🙂", "你好", "héllo wörld — ", "héllo wörld — 你好"),
        ("héllo wörld — 你好 🙂", "🙂", "héllo wörld — 你好 ", "héllo wörld — 你好 🙂"),
    ],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(
    tokenizer: Any, text: str, stop: str, before: str, through: str, include: bool
) -> None:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, stop=[stop, "never-there"], include_stop_str_in_output=include)
    _, index, matched = stream(detok, ids)
    assert matched == stop
    assert index == first_push_showing(tokenizer, ids, stop), "must stop on the token completing the match"
    assert detok.text == (through if include else before)
    assert text.startswith(detok.text)


def test_stop_string_spanning_tokens_is_really_split(tokenizer: Any) -> None:
    """Guard for the parametrized case above: the stop string must not sit inside a single token."""
    ids = encode(tokenizer, "héllo wörld — 你好 🙂")
    for stop in ("llo wö", "你好"):
        end = first_push_showing(tokenizer, ids, stop)
        assert stop not in tokenizer.decode([ids[end]])
        assert stop not in tokenizer.decode(ids[end - 1 : end + 1])


def test_no_stop_string_no_truncation(tokenizer: Any) -> None:
    text = "Hello, world! return value"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, stop=["xyz", "worlds"])
    deltas, index, matched = stream(detok, ids)
    assert index is None and matched is None
    assert "".join(deltas) + detok.finish() == detok.text == text


@pytest.mark.parametrize("include", [False, True])
def test_streamed_deltas_agree_with_final_text_when_stop_spans_tokens(tokenizer: Any, include: bool) -> None:
    ids = encode(tokenizer, "héllo wörld — 你好 🙂")
    detok = IncrementalDetokenizer(tokenizer, stop=["llo wö"], include_stop_str_in_output=include)
    deltas, _, matched = stream(detok, ids)
    assert matched == "llo wö"
    assert "".join(deltas) == detok.text


@pytest.mark.parametrize("include", [False, True])
def test_earliest_of_several_stop_strings_wins(tokenizer: Any, include: bool) -> None:
    ids = encode(tokenizer, "def return")
    assert tokenizer.decode([ids[-1]]) == " return"  # both stop strings arrive in one token
    detok = IncrementalDetokenizer(tokenizer, stop=["n", "t"], include_stop_str_in_output=include)
    _, _, matched = stream(detok, ids)
    assert matched == "t"
    assert detok.text == ("def ret" if include else "def re")

"""End-to-end behaviour of the offline API and CLI on a tiny model: text, stops, seeds, dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir))


def test_text_prompts_decode_to_output_tokens(llm: LLM) -> None:
    outs = llm.generate(["Hello world", "def main():"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for out in outs:
        assert len(out.token_ids) == 20
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_outputs_carry_request_times(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.times is not None and out.times.first_token is not None and out.times.finished is not None
    assert out.times.arrival <= out.times.first_token <= out.times.finished


def test_stop_string_truncates_output(llm: LLM) -> None:
    prompt = "import os\nimport sys\n"
    full = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[8:11]
    assert stop.strip(), "the test needs a visible stop string"
    cut = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        [prompt],
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids(llm: LLM) -> None:
    full = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate([[7, 8, 9]], params)[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], params)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    in_batch = llm.generate([[9, 9], [3, 4, 5], [1]], [others, params, others])[1].token_ids
    assert alone == in_batch
    other_seed = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_min_tokens_suppresses_stop_tokens(llm: LLM) -> None:
    full = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = full.token_ids[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=3)
    out = llm.generate([[7, 8, 9]], params)[0]
    assert len(out.token_ids) >= 3
    assert stop_id not in out.token_ids[:3]


def test_bfloat16_runs(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="bfloat16")
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_cli_generate_jsonl(llama_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    records = [
        {"id": "a", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True},
        {"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
        {"id": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    results = tmp_path / "results.jsonl"
    assert cli_main(["generate", str(llama_dir), "--input", str(prompts), "--output", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert [len(r["token_ids"]) for r in rows] == [5, 3, 4]
    assert rows[1]["num_prompt_tokens"] == 3
    expected = LLM(str(llama_dir)).generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert rows[1]["token_ids"] == expected[0].token_ids

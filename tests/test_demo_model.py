"""The committed demo model: a small Llama trained on the standard library's Python (`kvyard.testing.train_demo`).
It must load through the same path as any checkpoint, answer in Python and stop on its own."""

from __future__ import annotations

import json

from kvyard import LLM, SamplingParams
from kvyard.testing.model_presets import DEMO_MODEL_DIR

README_QUESTION = "Return True if the path exists."  # the README's curl, with its sampling settings
README_SAMPLING = SamplingParams(max_tokens=300, temperature=0.5, seed=3)


def test_the_demo_model_is_small_and_says_how_it_was_made() -> None:
    weights = DEMO_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 20 << 20
    info = json.loads((DEMO_MODEL_DIR / "train_info.json").read_text())
    assert info["held_out_perplexity"] < info["held_out_perplexity_before"] / 10
    assert info["settings"]["minutes"] <= 60


def test_the_demo_model_writes_python_and_stops() -> None:
    with LLM(str(DEMO_MODEL_DIR)) as llm:
        chat = llm.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": README_QUESTION}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        answer = llm.generate([list(chat)], README_SAMPLING)[0]
    assert answer.finish_reason == "stop", answer.text  # its end-of-turn token, before max_tokens
    assert len(answer.token_ids) < README_SAMPLING.max_tokens
    lines = answer.text.strip().splitlines()
    assert lines[0].startswith(("def ", "class ")) and lines[0].endswith(":"), answer.text  # Python-shaped text
    assert any(line.strip().startswith(("return ", "raise ", "if ")) for line in lines[1:]), answer.text

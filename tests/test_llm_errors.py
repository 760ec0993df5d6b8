"""Bad input to the offline API raises a clear exception naming the problem, and leaves the engine usable."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from kvyard import LLM, SamplingParams
from kvyard.models.config import UnsupportedModelError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=64)


def _still_works(llm: LLM) -> None:
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 4
    assert llm.engine.block_pool.num_used_blocks == 0


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 1.*empty"):
        llm.generate([[5, 6], []], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    _still_works(llm)


def test_prompt_longer_than_context(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt has 64 tokens; the model's context is 64"):
        llm.generate([[1] * 64], GREEDY)
    _still_works(llm)


def test_token_outside_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**7]], GREEDY)
    _still_works(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_wrong_prompt_type(llm: LLM) -> None:
    with pytest.raises(TypeError, match="prompt 0 must be a string or a list of token ids"):
        llm.generate([3.5], GREEDY)  # type: ignore[list-item]
    _still_works(llm)


def test_generation_stops_at_context_end(llm: LLM) -> None:
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_unknown_architecture(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"'architectures'.*GPTNeoXForCausalLM.*not supported"):
        LLM(str(model_dir))


def test_missing_weights(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    for path in model_dir.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        LLM(str(model_dir))


def test_bad_dtype(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype 'float8' is not supported"):
        LLM(str(llama_dir), dtype="float8")


def test_a_sliding_window_model_is_refused_past_its_window(llama_dir: Path, tmp_path: Path) -> None:
    """Mistral-style sliding-window attention is not implemented: refuse rather than answer wrongly."""
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=32.*--max-model-len 32"):
        LLM(str(model_dir))
    within = LLM(str(model_dir), max_model_len=32)  # the window covers the whole context: exact attention
    assert len(within.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 4
    config.update(use_sliding_window=False)  # Qwen2 and Qwen3 configs carry a window they do not use
    (model_dir / "config.json").write_text(json.dumps(config))
    assert LLM(str(model_dir)).engine.max_model_len > 32


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}, "rope_parameters": None}, "rope type 'longrope'"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(
    llama_dir: Path, tmp_path: Path, fields: dict[str, object], named: str
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    config = {**json.loads((model_dir / "config.json").read_text()), **fields}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        LLM(str(model_dir))

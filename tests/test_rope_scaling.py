"""Rotary embeddings with scaling (linear, llama3, yarn) give transformers' greedy tokens and log-probs on the same
weights: the tiny Llama with each rope type written into its config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hf_parity import GREEDY, NUM_NEW_TOKENS, Reference, _prompts

from kvyard import LLM, SamplingParams
from kvyard.models.config import load_model_config
from kvyard.models.rope_tables import rope_attention_factor

ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
}


@pytest.fixture(scope="module", params=sorted(ROPES))
def scaled(request: Any, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    model_dir = tmp_path_factory.mktemp(f"llama-{request.param}")
    shutil.copytree(model_dirs["llama"], model_dir, dirs_exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {**ROPES[request.param], "rope_theta": 10_000.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir, request.param


def test_scaled_rope_matches_transformers(scaled: tuple[Path, str]) -> None:
    model_dir, name = scaled
    reference = Reference(model_dir)
    vocab = reference.model.config.vocab_size
    prompts = _prompts(vocab)[3:]  # 17, 40 and 70 tokens: past the 64 pretrained positions
    llm = LLM(str(model_dir))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference.tokens(prompts)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    output = llm.generate(prompts[-1:], params)[0]
    _, expected = reference.run(prompts[-1])
    ours = torch.tensor([step.logprob for step in output.logprobs])
    theirs = expected[torch.arange(len(output.token_ids)), torch.tensor(output.token_ids)]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    factor = rope_attention_factor(load_model_config(model_dir).rope)
    assert factor != 1.0 if name.startswith("yarn") else factor == 1.0

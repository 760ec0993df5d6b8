"""DeepSeek-V3 (latent attention over a cache of one latent row per token, grouped sigmoid routing, a shared expert,
a dense first layer) gives transformers' greedy tokens and log-probs on the same random weights: in a batch of mixed
lengths, from the prefix cache, in 7-token prefill chunks and after preemption; its latent blocks go through the KV
tier byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_kv_format import _stored_blocks
from transformers import AutoModelForCausalLM

from kvyard import LLM, SamplingParams
from kvyard.engine.runners.model_runner import kv_block_bytes
from kvyard.kvcache.config import KVTierConfig
from kvyard.models.config import load_model_config
from kvyard.models.kv_format import KVFormat
from kvyard.testing.create_model import create_model

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model("deepseek_v3", "tiny", tmp_path_factory.mktemp("deepseek") / "deepseek_v3")


@pytest.fixture(scope="module")
def reference(deepseek: Path) -> AutoModelForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(
        deepseek, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def _prompts(count: int, seed: int, vocab: int = 1000) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (1, 5, 17, 40, 70)[:count]]


def _greedy(model: AutoModelForCausalLM, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.logits, 1)[0].log_softmax(-1)


def test_a_batch_of_mixed_lengths_and_its_log_probs_match_transformers(
    deepseek: Path, reference: AutoModelForCausalLM
) -> None:
    prompts = _prompts(5, 1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = LLM(str(deepseek)).generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        tokens, log_probs = _greedy(reference, prompt)
        assert output.token_ids == tokens
        ours = torch.tensor([step.logprob for step in output.logprobs])
        torch.testing.assert_close(ours, log_probs[torch.arange(NEW_TOKENS), torch.tensor(tokens)], rtol=0, atol=1e-4)


def test_prefix_hits_prefill_chunks_and_preemption_keep_transformers_tokens(
    deepseek: Path, reference: AutoModelForCausalLM
) -> None:
    prefix = _prompts(5, 2)[4]
    prompts = [prefix + tail for tail in _prompts(3, 3)]
    expected = [_greedy(reference, prompt)[0] for prompt in prompts]
    with LLM(str(deepseek), max_num_batched_tokens=7) as chunked:
        chunked.generate([prefix], GREEDY)
        outputs = chunked.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected
        assert all(o.num_cached_tokens >= 64 for o in outputs)
    with LLM(str(deepseek), num_kv_blocks=12, max_model_len=128) as tight:
        assert [o.token_ids for o in tight.generate(prompts, GREEDY)] == expected
        assert tight.engine.scheduler.num_preemptions > 0


def test_the_cache_keeps_one_latent_row_per_token_and_layer(deepseek: Path) -> None:
    config = load_model_config(deepseek)
    assert config.latent is not None and config.kv_planes == 1 and config.num_kv_heads == 1
    per_token = kv_block_bytes(config, 16, KVFormat.resolve("auto", torch.float32)) // 16 // config.num_layers
    assert per_token == 4 * (config.latent.kv_lora_rank + config.latent.qk_rope_head_dim)  # fp32: 24 values


def test_latent_rows_round_trip_through_the_disk_tier(deepseek: Path, tmp_path: Path) -> None:
    """A second engine loads the first one's latent blocks from disk, byte for byte, and answers the same."""
    tier = KVTierConfig(tiers=("disk",), disk_dir=str(tmp_path / "blocks"), load_deadline_s=60)
    prompt = _prompts(5, 4)[4]
    with LLM(str(deepseek), kv_tier=tier) as writer:
        first = writer.generate([prompt], GREEDY)[0]
        written = _stored_blocks(writer, prompt)
    with LLM(str(deepseek), kv_tier=tier) as reader:
        second = reader.generate([prompt], GREEDY)[0]
        loaded = _stored_blocks(reader, prompt)
    assert second.num_cached_tokens == len(prompt) // 16 * 16
    assert second.token_ids == first.token_ids
    assert loaded == written

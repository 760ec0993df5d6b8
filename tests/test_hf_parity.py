"""kvyard's greedy output must equal Hugging Face transformers' token for token, on the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvyard import LLM, SamplingParams

NUM_NEW_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 16, 17, 40, 70)
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(99)
    prefix = torch.randint(0, vocab_size, (37,), generator=generator).tolist()
    tails = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 11, 20)]
    return [prefix + tail for tail in tails]


class Reference:
    """Greedy continuations and per-step log-probs from the transformers implementation."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def run(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        key = tuple(prompt)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),  # else generate masks the prompt's token 0 as padding
                    max_new_tokens=NUM_NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            log_probs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
            self._cache[key] = (out.sequences[0, len(prompt) :].tolist(), log_probs)
        return self._cache[key]

    def tokens(self, prompts: list[list[int]]) -> list[list[int]]:
        return [self.run(p)[0] for p in prompts]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def arch_setup(
    request: Any, model_dirs: dict[str, Path], moe_model_dirs: dict[str, Path]
) -> tuple[Path, Reference, int]:
    model_dir = {**model_dirs, **moe_model_dirs}[request.param]
    reference = Reference(model_dir)
    return model_dir, reference, reference.model.config.vocab_size


def test_batch_of_mixed_lengths_matches_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    model_dir, reference, vocab = arch_setup
    prompts = _prompts(vocab)
    outputs = LLM(str(model_dir)).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference.tokens(prompts)


def test_log_probs_match_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    model_dir, reference, vocab = arch_setup
    prompts = _prompts(vocab)[2:4]
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt, output in zip(prompts, LLM(str(model_dir)).generate(prompts, params)):
        _, ref_log_probs = reference.run(prompt)
        assert output.logprobs is not None and len(output.logprobs) == NUM_NEW_TOKENS
        for step, entry in enumerate(output.logprobs):
            assert entry.logprob == pytest.approx(float(ref_log_probs[step, entry.token_id]), abs=1e-4)
            for token_id, value in entry.top.items():
                assert value == pytest.approx(float(ref_log_probs[step, token_id]), abs=1e-4)


def test_prefix_cache_hits_keep_outputs_identical(arch_setup: tuple[Path, Reference, int]) -> None:
    model_dir, reference, vocab = arch_setup
    prompts = _shared_prefix_prompts(vocab)
    llm = LLM(str(model_dir))
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 32 for o in second)  # two full 16-token blocks of the shared prefix
    assert [o.token_ids for o in second] == reference.tokens(prompts)
    again = llm.generate(prompts, GREEDY)  # whole prompts (and their outputs' blocks) now cached
    assert [o.token_ids for o in again] == [o.token_ids for o in second]
    assert all(a.num_cached_tokens >= b.num_cached_tokens for a, b in zip(again, second))


def test_small_prefill_chunks_match_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    model_dir, reference, vocab = arch_setup
    prompts = _prompts(vocab)
    outputs = LLM(str(model_dir), max_num_batched_tokens=7).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference.tokens(prompts)


def test_long_steps_while_nothing_streams_match_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    """Prompts admitted while nothing streams are prefilled in 64-token steps, the rest in chunks of 7 beside the
    running decodes: the chunking changes, the tokens do not."""
    model_dir, reference, vocab = arch_setup
    prompts = _prompts(vocab)
    outputs = LLM(str(model_dir), max_num_batched_tokens=7, prefill_only_step_tokens=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference.tokens(prompts)


def test_shortest_prompts_first_match_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    """Prompts computed fewest-tokens-left first, in 7-token steps and a pool small enough to preempt: the order
    and the chunks change, the tokens do not."""
    model_dir, reference, vocab = arch_setup
    prompts = _prompts(vocab)
    llm = LLM(str(model_dir), max_num_batched_tokens=7, prefill_order="shortest", block_size=4, num_kv_blocks=28)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference.tokens(prompts)
    assert llm.engine.block_pool.num_used_blocks == 0


def test_preemption_with_tiny_pool_matches_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    model_dir, reference, vocab = arch_setup
    prompts = _prompts(vocab)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=28, enable_prefix_caching=False)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference.tokens(prompts)
    llm.engine.block_pool.check_invariants()
    assert llm.engine.block_pool.num_used_blocks == 0


def test_preemption_with_prefix_cache_matches_reference(arch_setup: tuple[Path, Reference, int]) -> None:
    model_dir, reference, vocab = arch_setup
    prompts = _shared_prefix_prompts(vocab) + _prompts(vocab)
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=30, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == reference.tokens(prompts)
    llm.engine.block_pool.check_invariants()

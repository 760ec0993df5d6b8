"""A request resumed from another replica's output continues it exactly (what the router's failover relies on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvyard import LLM, SamplingParams
from kvyard.engine.core import RequestOutput

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), max_model_len=256)


def _run(
    llm: LLM, request_id: str, prompt: list[int], resumed: list[int], params: SamplingParams = GREEDY
) -> list[RequestOutput]:
    llm.engine.add_request(request_id, prompt, params, resumed_output_ids=resumed)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += [output for output in llm.engine.step() if output.request_id == request_id]
    return outputs


@pytest.mark.parametrize("num_resumed", [1, 13, 39])
def test_a_resumed_greedy_request_ends_as_the_uninterrupted_one(llm: LLM, num_resumed: int) -> None:
    prompt = llm.tokenizer.encode("The lighthouse keeper counted the ships")
    reference = _run(llm, f"ref-{num_resumed}", prompt, [])[-1]
    llm.reset_prefix_cache()  # the resumed request computes its tokens again, as on another replica
    outputs = _run(llm, f"resumed-{num_resumed}", prompt, reference.token_ids[:num_resumed])
    final = outputs[-1]
    assert final.token_ids == reference.token_ids and final.text == reference.text
    assert sum(len(output.new_token_ids) for output in outputs) == GREEDY.max_tokens - num_resumed
    assert final.prompt_token_ids == prompt and final.finish_reason == "length"
    assert llm.engine.block_pool.num_used_blocks == 0


def test_a_resumed_seeded_sample_continues_the_same_draws(llm: LLM) -> None:
    sampled = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = llm.tokenizer.encode("Once upon a time")
    reference = _run(llm, "seeded-ref", prompt, [], sampled)[-1]
    assert _run(llm, "seeded-again", prompt, [], sampled)[-1].token_ids == reference.token_ids
    other_seed = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=1235, ignore_eos=True)
    assert _run(llm, "seeded-other", prompt, [], other_seed)[-1].token_ids != reference.token_ids
    resumed = _run(llm, "seeded-resumed", prompt, reference.token_ids[:11], sampled)[-1]
    assert resumed.token_ids == reference.token_ids


def test_resumed_tokens_count_toward_max_tokens(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"resume.token_ids holds 40 tokens; max_tokens=40"):
        llm.engine.add_request("too-many", [1, 2, 3], GREEDY, resumed_output_ids=[5] * 40)
    with pytest.raises(ValueError, match=r"resume.token_ids"):
        llm.engine.add_request("bad-id", [1, 2, 3], GREEDY, resumed_output_ids=[10**9])
    assert not llm.engine.has_unfinished_requests()

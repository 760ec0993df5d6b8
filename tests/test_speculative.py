"""Speculative decoding: under greedy decoding the output with speculation is the output without it, token for
token, whatever the proposer guesses; accepted guesses save steps; rejected ones leave no trace in the cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvyard import LLM, SamplingParams
from kvyard.engine.runners.model_runner import accept_greedy
from kvyard.engine.scheduling.request import Request
from kvyard.engine.speculative.policy import NgramProposer, SpeculativeConfig
from kvyard.testing.oracle_proposer import OracleProposer

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup proposes), of different lengths."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        motif = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 9))]
        out.append((motif * 40)[: 20 + 7 * index] + [rng.randrange(3, 500) for _ in range(5)])
    return out


def token_ids(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(batch, params)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- units


def request_of(tokens: list[int]) -> Request:
    return Request(f"r{tokens}", tokens, GREEDY, b"\0" * 16, block_size=4)


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix() -> None:
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    assert proposer.propose_one(request_of([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]), 2) == [7, 1]  # the latest, longest match
    assert proposer.propose_one(request_of([5, 6, 7]), 4) == []  # nothing repeats
    request = request_of([4, 5, 4])
    assert proposer.propose_one(request, 3) == [5, 4]
    request.append_token(5)  # the index grows with the sequence
    assert proposer.propose_one(request, 3) == [4, 5]


def test_greedy_acceptance_keeps_the_agreeing_run_and_the_models_own_next_token() -> None:
    assert accept_greedy([7, 8, 9], [7, 8, 9, 10]) == [7, 8, 9, 10]
    assert accept_greedy([7, 8, 9], [7, 5, 9, 10]) == [7, 5]
    assert accept_greedy([7, 8, 9], [1, 8, 9, 10]) == [1]
    assert accept_greedy([], [3]) == [3]


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ngram_speculation_gives_the_output_without_it(model_dirs: dict[str, Path], arch: str) -> None:
    batch = prompts(8)
    reference = token_ids(LLM(str(model_dirs[arch])), batch)
    with LLM(str(model_dirs[arch]), speculative=NGRAM) as llm:
        assert token_ids(llm, batch) == reference
        stats = llm.engine.stats()
        assert stats.spec_proposed_tokens > 0


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_verified_guesses_are_kept_and_wrong_ones_recomputed_exactly(llama_dir: Path, error_rate: float) -> None:
    batch = prompts(16, seed=1)
    reference = token_ids(LLM(str(llama_dir)), batch)
    with LLM(str(llama_dir), speculative=NGRAM) as llm:
        oracle = OracleProposer({tuple(p): r for p, r in zip(batch, reference)}, error_rate)
        llm.engine.proposer = oracle
        assert token_ids(llm, batch) == reference
        stats = llm.engine.stats()
        assert stats.spec_proposed_tokens == oracle.proposed > 0
        if error_rate == 0.0:
            assert stats.spec_accepted_tokens == stats.spec_proposed_tokens
        if error_rate == 1.0:
            assert stats.spec_accepted_tokens == 0


def test_speculation_is_exact_with_prefix_hits_chunked_prefill_and_preemption(llama_dir: Path) -> None:
    batch = prompts(12, seed=2)
    reference = token_ids(LLM(str(llama_dir)), batch)
    # 24 blocks of 16 tokens cannot hold twelve sequences at once: requests are preempted and recomputed; a
    # 32-token step budget chunks every prefill, and the second round finds the prompts in the prefix cache.
    with LLM(str(llama_dir), speculative=NGRAM, num_kv_blocks=24, max_num_batched_tokens=32) as llm:
        oracle = OracleProposer({tuple(p): r for p, r in zip(batch, reference)}, error_rate=0.3)
        llm.engine.proposer = oracle
        assert token_ids(llm, batch) == reference
        assert token_ids(llm, batch) == reference
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0 and stats.spec_accepted_tokens > 0


def test_rejected_guesses_never_enter_the_prefix_cache(llama_dir: Path) -> None:
    batch = prompts(4, seed=3)
    reference = token_ids(LLM(str(llama_dir)), batch)
    with LLM(str(llama_dir), speculative=NGRAM) as llm:
        llm.engine.proposer = OracleProposer({tuple(p): r for p, r in zip(batch, reference)}, error_rate=1.0)
        token_ids(llm, batch)
        cached = set(llm.engine.block_pool.cached_block_keys())
    with LLM(str(llama_dir)) as plain:
        token_ids(plain, batch)
        assert cached == set(plain.engine.block_pool.cached_block_keys())


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.8, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9)])
def test_seeded_sampled_requests_speculate_and_give_the_output_without_speculation(
    llama_dir: Path, temperature: float, top_k: int, top_p: float
) -> None:
    batch = prompts(6, seed=4)
    sampled = [
        SamplingParams(max_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=3 + i, ignore_eos=True)
        for i in range(len(batch))
    ]
    reference = [output.token_ids for output in LLM(str(llama_dir)).generate(batch, sampled)]  # type: ignore[arg-type]
    with LLM(str(llama_dir), speculative=NGRAM) as llm:
        # Guesses of what the seeded draws were, 30% of them wrong: both the keep and the reject path.
        llm.engine.proposer = OracleProposer({tuple(p): r for p, r in zip(batch, reference)}, 0.3)
        outputs = [output.token_ids for output in llm.generate(batch, sampled)]  # type: ignore[arg-type]
        assert outputs == reference
        assert llm.engine.stats().spec_accepted_tokens > 0


# The 99.9% points of chi-square, by degrees of freedom.
CHI_SQUARE_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    total = sum(counts)
    cells = [(count, total * p) for count, p in zip(counts, probs) if p > 0]
    return sum((count - expected) ** 2 / expected for count, expected in cells), len(cells) - 1


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 3, 1.0), (1.0, 0, 0.8)]
)
def test_unseeded_speculative_sampling_keeps_the_target_distribution(
    temperature: float, top_k: int, top_p: float
) -> None:
    """The runner's rule with the real sampler on fixed logits: both positions' draws, then the kept prefix."""
    import torch

    from kvyard.engine.sampling.sampler import SamplingRow, _processed_probs, sample

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.5, 0.3, -0.5]])
    target = _processed_probs(logits.clone(), [params, params])
    rows = [SamplingRow(params, None), SamplingRow(params, None)]
    torch.manual_seed(11)
    samples = 20000
    for guess in (0, 2):  # the likeliest token, and a less likely one
        first, second = [0] * 6, [0] * 6
        for _ in range(samples):
            drawn, _ = sample(logits.clone(), rows)
            emitted = accept_greedy([guess], drawn)
            first[emitted[0]] += 1
            if len(emitted) == 2:
                second[emitted[1]] += 1
        for counts, probs in ((first, target[0]), (second, target[1])):
            statistic, dof = chi_square(counts, probs.tolist())
            assert statistic < CHI_SQUARE_999[dof], (guess, counts, probs.tolist())
    # The same test would catch a rule that keeps every guess: all mass on the guess.
    statistic, dof = chi_square([0, 0, samples, 0, 0, 0], target[0].tolist())
    assert statistic > CHI_SQUARE_999[dof]


def test_a_request_can_turn_speculation_off(llama_dir: Path) -> None:
    batch = prompts(4, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculate=False)
    with LLM(str(llama_dir), speculative=NGRAM) as llm:
        llm.engine.proposer = OracleProposer({tuple(p): [0] * 16 for p in batch}, 0.0)
        token_ids(llm, batch, params)
        assert llm.engine.stats().spec_proposed_tokens == 0


def test_proposals_shrink_to_probes_when_guesses_are_wrong_and_stay_long_when_right() -> None:
    from kvyard.engine.speculative.policy import num_tokens_to_propose, updated_acceptance

    assert num_tokens_to_propose(0.9, 4, 0.1) == 4
    assert num_tokens_to_propose(0.0, 4, 0.1) == 0
    assert 0 < num_tokens_to_propose(0.4, 8, 0.1) < 8
    assert updated_acceptance(0.5, 4, 4) > 0.5 > updated_acceptance(0.5, 4, 0)
    assert updated_acceptance(0.5, 4, 2) == 0.5 + 0.3 * (2 / 3 - 0.5)  # two kept, then one wrong


def test_adaptive_speculation_stops_proposing_for_a_request_whose_guesses_are_all_wrong(llama_dir: Path) -> None:
    batch = prompts(4, seed=6)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    reference = token_ids(LLM(str(llama_dir)), batch, params)
    with LLM(str(llama_dir), speculative=NGRAM) as llm:
        llm.engine.proposer = OracleProposer({tuple(p): r for p, r in zip(batch, reference)}, error_rate=1.0)
        assert token_ids(llm, batch, params) == reference
        proposed = llm.engine.stats().spec_proposed_tokens
    # Without adaptation each of the ~63 decode steps of 4 requests would propose 4 tokens (about 1,000 in all);
    # after a few wrong steps only one-token probes remain, 8, 16 and 32 steps apart.
    assert proposed < 4 * (4 * 4 + 3 + 1)


def test_the_measured_verify_cost_grows_with_the_batch() -> None:
    from kvyard.engine.speculative.policy import StepCost

    cost = StepCost()
    for tokens in (1, 2, 4, 8, 16, 32, 64, 5, 40):
        cost.observe(tokens, 0.010 + 0.001 * tokens)  # 10 ms to read the weights, 1 ms per token
    one, eight = cost.verify_token_cost(1), cost.verify_token_cost(8)
    assert one is not None and eight is not None
    assert abs(one - 0.001 / 0.011) < 1e-6 and abs(eight - 0.008 / 0.018) < 1e-6
    assert StepCost().verify_token_cost(1) is None  # nothing measured yet: the configured figure is used


def test_speculating_requests_get_the_logprobs_of_plain_decoding(llama_dir: Path) -> None:
    """Bit for bit: a verification computes each position as a decode step does (one decode query per position).
    Three requests verifying 5 tokens each stay within the 16 rows of fp32's few-rows kernels, whose bits do not
    depend on the number of rows; beyond them (plain decoding of a large batch too) oneDNN's matmul sums otherwise."""
    batch = prompts(3, seed=8)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    with LLM(str(llama_dir)) as plain:
        reference = plain.generate(batch, params)
    with LLM(str(llama_dir), speculative=NGRAM) as llm:
        # guesses 30% wrong: tokens come both from accepted runs and from the model's own next token
        llm.engine.proposer = OracleProposer({tuple(p): list(r.token_ids) for p, r in zip(batch, reference)}, 0.3)
        outputs = llm.generate(batch, params)
        assert llm.engine.stats().spec_accepted_tokens > 0
    for ours, theirs in zip(outputs, reference):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs is not None and theirs.logprobs is not None and len(ours.logprobs) == 16
        assert ours.logprobs == theirs.logprobs

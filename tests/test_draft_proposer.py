"""Model proposers (draft, self-int8, self-fp16): the output under greedy decoding is the output
without speculation, token for token; a self-draft computes with its scheme's weights over the served model's KV,
borrowing blocks of its pool for a step and giving them back; a draft keeps its own KV right across steps,
evictions and long prompts; a draft that cannot propose for the served model is refused at load time with the
reason."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from kvyard import LLM, SamplingParams
from kvyard.engine.speculative.draft_proposer import DraftModelError, DraftModelProposer
from kvyard.engine.speculative.policy import SpeculativeConfig
from kvyard.engine.speculative.self_draft import SelfDraftProposer
from kvyard.models.quantization import HalfLinear, Int8Linear
from kvyard.testing.create_model import create_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SELF_INT8 = SpeculativeConfig(method="self-int8", num_speculative_tokens=4, adaptive=False)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(20 + 7 * index)] for index in range(count)]


def token_ids(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(batch, params)]


def draft(method: str, draft_dir: Path | None = None, **options: object) -> SpeculativeConfig:
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=4,
        adaptive=False,
        draft_model=str(draft_dir) if draft_dir else None,
        **options,
    )  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny Llama: the same tokenizer, other weights (a draft that is often wrong)."""
    return create_model("llama", "tiny", tmp_path_factory.mktemp("draft") / "llama", seed=1)


SELF_CASES = [
    ("llama", "self-int8", 0.5),
    ("qwen2", "self-int8", 0.5),
    ("qwen3", "self-int8", 0.5),
    ("qwen3", "self-fp16", 0.9),
]


@pytest.mark.parametrize(("arch", "method", "min_acceptance"), SELF_CASES)
def test_self_speculation_gives_the_output_without_it(
    model_dirs: dict[str, Path], arch: str, method: str, min_acceptance: float
) -> None:
    batch = prompts(8)
    reference = token_ids(LLM(str(model_dirs[arch])), batch)
    with LLM(str(model_dirs[arch]), speculative=draft(method)) as llm:
        assert token_ids(llm, batch) == reference
        stats = llm.engine.stats()
        # the converted weights mostly agree with fp32 on the next token (fp16 almost always): guesses are kept
        assert stats.spec_accepted_tokens > min_acceptance * stats.spec_proposed_tokens > 0


@pytest.mark.parametrize(("method", "dtype"), [("self-int8", torch.int8), ("self-fp16", torch.float16)])
def test_a_self_draft_computes_with_its_schemes_weights(llama_dir: Path, method: str, dtype: torch.dtype) -> None:
    with LLM(str(llama_dir), speculative=draft(method)) as llm:
        proposer = llm.engine.proposer
        assert isinstance(proposer, SelfDraftProposer)
        model = proposer.passes.paged.model
        converted = [module for module in model.modules() if isinstance(module, (Int8Linear, HalfLinear))]
        assert not any(isinstance(module, nn.Linear) for module in model.modules())  # every linear, the head too
        assert model.lm_head in converted and {weight_dtype(module) for module in converted} == {dtype}


def weight_dtype(module: nn.Module) -> torch.dtype:
    assert isinstance(module, (Int8Linear, HalfLinear)), f"{type(module).__name__} is not a converted layer"
    return module.qweight.dtype if isinstance(module, Int8Linear) else module.weight16.dtype


def test_a_draft_model_with_other_weights_gives_the_output_without_it(llama_dir: Path, other_llama_dir: Path) -> None:
    batch = prompts(8, seed=1)
    reference = token_ids(LLM(str(llama_dir)), batch)
    with LLM(str(llama_dir), speculative=draft("draft", other_llama_dir)) as llm:
        assert token_ids(llm, batch) == reference
        assert llm.engine.stats().spec_proposed_tokens > 0


def test_a_draft_with_the_served_weights_has_its_guesses_kept(llama_dir: Path, tmp_path: Path) -> None:
    """The draft's KV holds what the served model's would: guesses of the same weights are (almost all) right,
    which they would not be if the draft's cache lost track of a sequence between steps."""
    same = Path(shutil.copytree(llama_dir, tmp_path / "same"))
    batch = prompts(6, seed=2)
    reference = token_ids(LLM(str(llama_dir)), batch)
    with LLM(str(llama_dir), speculative=draft("draft", same)) as llm:
        assert token_ids(llm, batch) == reference
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens >= 0.95 * stats.spec_proposed_tokens > 0


def test_model_proposers_are_exact_with_prefix_hits_chunked_prefill_preemption_and_eviction(llama_dir: Path) -> None:
    batch = prompts(12, seed=3)
    # 24 blocks cannot hold twelve sequences: the target preempts, and the draft (as many blocks) evicts the KV of
    # the requests it served least recently; 32-token steps chunk every prefill; the second round hits the cache.
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    reference = token_ids(LLM(str(llama_dir)), batch, params)
    options = {"num_kv_blocks": 24, "max_num_batched_tokens": 32}
    with LLM(str(llama_dir), speculative=SELF_INT8, **options) as llm:
        assert token_ids(llm, batch, params) == reference
        assert token_ids(llm, batch, params) == reference
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0 and stats.spec_accepted_tokens > 0


def test_a_long_prompt_is_caught_up_over_several_steps_before_the_draft_guesses(
    llama_dir: Path, tmp_path: Path
) -> None:
    same = Path(shutil.copytree(llama_dir, tmp_path / "same"))
    batch = [list(range(3, 83))]
    reference = token_ids(LLM(str(llama_dir)), batch)
    with LLM(str(llama_dir), speculative=draft("draft", same, max_draft_catch_up=16)) as llm:
        engine = llm.engine
        engine.add_request("long", batch[0], GREEDY)
        proposer = engine.proposer
        assert isinstance(proposer, DraftModelProposer)
        computed = []
        while engine.has_unfinished_requests():
            engine.step()
            sequence = proposer._sequences.get("long")
            computed.append(sequence.num_computed if sequence else 0)
        # the prefill is one step (the target's); the draft then takes 16 prompt tokens a step
        assert computed[1:5] == [16, 32, 48, 64]
        assert engine.stats().spec_accepted_tokens > 0
    with LLM(str(llama_dir), speculative=draft("draft", same, max_draft_catch_up=16)) as llm:
        assert token_ids(llm, batch) == reference


def test_a_self_draft_guesses_from_the_first_decode_step_over_the_served_models_kv(llama_dir: Path) -> None:
    """No catch-up: the draft reads the prompt's KV the served model computed (here partly from the prefix
    cache), so its first guesses come with the first decode step and are kept; the blocks it borrowed for a step
    are back in the pool after it, every one free once the requests are done."""
    prompt = list(range(3, 83))
    reference = token_ids(LLM(str(llama_dir)), [prompt, prompt[:64] + [7] * 9])
    with LLM(str(llama_dir), speculative=SELF_INT8) as llm:
        engine = llm.engine
        pool = engine.block_pool
        assert token_ids(llm, [prompt]) == reference[:1]
        engine.add_request("hit", prompt[:64] + [7] * 9, GREEDY)
        engine.step()  # the prefill, 64 tokens of it from the prefix cache
        request = engine.scheduler.running[0]
        assert request.num_computed_tokens == 73 and engine.stats().prefix_cache_hit_tokens >= 64
        before = engine.stats()
        outputs = engine.step()  # the first decode step verifies the draft's first guesses
        after = engine.stats()
        assert after.spec_proposed_tokens - before.spec_proposed_tokens == 4
        assert after.spec_accepted_tokens - before.spec_accepted_tokens >= 2
        assert len(outputs[0].new_token_ids) >= 3
        assert pool.num_used_blocks == len(request.block_table)  # what the draft borrowed went back
        while engine.has_unfinished_requests():
            engine.step()
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_blocks
    with LLM(str(llama_dir), speculative=SELF_INT8) as llm:
        assert token_ids(llm, [prompt, prompt[:64] + [7] * 9]) == reference


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp16"])
def test_a_self_draft_reads_and_writes_the_served_models_kv_format(llama_dir: Path, kv_cache_dtype: str) -> None:
    """Over an int8 or fp16 cache the draft reads the served model's rows in that format and writes its guesses'
    rows in it too: the output is the output without speculation, and most guesses are kept."""
    batch = prompts(6, seed=10)
    reference = token_ids(LLM(str(llama_dir), kv_cache_dtype=kv_cache_dtype), batch)
    with LLM(str(llama_dir), speculative=SELF_INT8, kv_cache_dtype=kv_cache_dtype) as llm:
        assert token_ids(llm, batch) == reference
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens > 0.5 * stats.spec_proposed_tokens > 0


def test_a_self_draft_leaves_the_served_models_blocks_as_they_were(llama_dir: Path) -> None:
    """Every block a request holds, and every block of the prefix cache, has the same bytes after a step of
    guessing as the served model left in it: the draft writes only blocks it borrowed."""
    with LLM(str(llama_dir), speculative=SELF_INT8) as llm:
        engine = llm.engine
        token_ids(llm, prompts(3, seed=8))  # the prefix cache holds their blocks
        for index, prompt in enumerate(prompts(4, seed=9)):
            engine.add_request(f"r{index}", prompt, GREEDY)
        engine.step()
        pool = engine.block_pool
        cached = [block for key in pool.cached_block_keys() if (block := pool.lookup(key)) is not None]
        held = [block for request in engine.scheduler.running for block in request.block_table]
        caches = engine.runner.kv_caches
        block_size = engine.runner.block_size

        def contents(blocks: list[int]) -> list[torch.Tensor]:
            slots = torch.tensor([block * block_size + i for block in blocks for i in range(block_size)])
            return [cache.index_select(1, slots).clone() for cache in caches]

        before = contents(held + cached)
        assert len(cached) >= 3 and pool.num_free_blocks > len(cached) + 16  # blocks to borrow, none evicted
        proposer = engine.proposer
        assert isinstance(proposer, SelfDraftProposer)
        proposer.propose(engine.scheduler.running, [4] * len(engine.scheduler.running))
        assert all(torch.equal(old, new) for old, new in zip(before, contents(held + cached), strict=True))


def test_sampled_requests_with_a_draft_keep_their_seeded_output(llama_dir: Path) -> None:
    batch = prompts(4, seed=4)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=9, ignore_eos=True)
    reference = token_ids(LLM(str(llama_dir)), batch, sampled)
    with LLM(str(llama_dir), speculative=SELF_INT8) as llm:
        assert token_ids(llm, batch, sampled) == reference
        assert llm.engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("num_blocks", [64, 10])  # 10: too few to warm up over 16 sequences
def test_released_requests_give_their_draft_blocks_back(
    llama_dir: Path, other_llama_dir: Path, num_blocks: int
) -> None:
    with LLM(str(llama_dir), speculative=draft("draft", other_llama_dir), num_kv_blocks=num_blocks) as llm:
        proposer = llm.engine.proposer
        assert isinstance(proposer, DraftModelProposer)
        assert sorted(proposer._free_blocks) == list(range(num_blocks))
        token_ids(llm, prompts(5, seed=5))
        assert not proposer._sequences and sorted(proposer._free_blocks) == list(range(num_blocks))


def test_a_draft_that_cannot_propose_for_the_model_is_refused(
    model_dirs: dict[str, Path], llama_dir: Path, tmp_path: Path
) -> None:
    small = create_model("llama", "small", tmp_path / "small")
    with pytest.raises(DraftModelError, match="vocabulary of 8000 tokens"):
        LLM(str(llama_dir), speculative=draft("draft", small))
    with pytest.raises(DraftModelError, match="maps tokens to other ids"):
        LLM(str(llama_dir), speculative=draft("draft", model_dirs["qwen2"]))  # same size, other tokenizer
    with pytest.raises(DraftModelError, match=r"no config\.json"):
        LLM(str(llama_dir), speculative=draft("draft", tmp_path / "missing"))
    with pytest.raises(DraftModelError, match="already runs converted weights"):
        LLM(str(llama_dir), speculative=SELF_INT8, quantization="int8")
    with pytest.raises(ValueError, match="needs --draft-model"):
        SpeculativeConfig(method="draft")


@pytest.mark.parametrize(("arch", "method"), [("llama", "self-int8"), ("qwen3", "self-fp16"), ("qwen2", "self-int8")])
def test_native_guessing_passes_guess_what_the_modules_guess(
    model_dirs: dict[str, Path], arch: str, method: str
) -> None:
    """Guessing passes run on the native kernels (kvyard.engine.speculative.native_draft) over the draft's own
    tensors and the served model's cache, a 16-bit head's argmax screened by its int8 copy; with them switched off the
    PyTorch modules run the same passes: every guess, hence every count of proposed and accepted tokens, is the same."""
    batch = prompts(6, seed=7)
    counts = []
    for native in (True, False):
        with LLM(str(model_dirs[arch]), speculative=draft(method)) as llm:
            proposer = llm.engine.proposer
            assert isinstance(proposer, SelfDraftProposer) and proposer.passes.native is not None
            assert (proposer.passes.native.screened_head is not None) == (method == "self-fp16")
            if not native:
                proposer.passes.native = None
            outputs = token_ids(llm, batch)
            stats = llm.engine.stats()
            counts.append((outputs, stats.spec_proposed_tokens, stats.spec_accepted_tokens))
    assert counts[0] == counts[1] and counts[0][1] > 0

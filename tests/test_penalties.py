"""Logit bias, repetition, frequency and presence penalties, and min-p: the batched sampler against a plain
per-row reference, Hugging Face's processors on the same weights, and speculative decoding kept exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvyard import LLM, SamplingParams
from kvyard.engine.sampling.penalties import TokenHistory, apply_logit_processing
from kvyard.engine.sampling.sampler import SamplingRow, sample
from kvyard.engine.speculative.policy import SpeculativeConfig
from kvyard.testing.oracle_proposer import OracleProposer

VOCAB = 64


def reference_processing(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """One row, in float64, token by token: bias, then repetition, then frequency and presence."""
    out = logits.double().clone()
    for token_id, bias in params.logit_bias.items():
        out[token_id] += bias
    seen = set(history.prompt_token_ids) | set(history.output_token_ids)
    for token_id in seen:
        value = float(out[token_id])
        out[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token_id in set(history.output_token_ids):
        count = list(history.output_token_ids).count(token_id)
        out[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return out


ROW_PARAMS = [
    SamplingParams(),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0, repetition_penalty=1.2, logit_bias={1: 3.0}),
]


def test_batched_processing_matches_the_per_row_reference() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(len(ROW_PARAMS), VOCAB) * 4
    histories = [
        TokenHistory(
            [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))],
            [rng.randrange(VOCAB // 4) for _ in range(rng.randrange(1, 40))],
        )
        for _ in ROW_PARAMS
    ]
    expected = torch.stack([reference_processing(logits[i], p, histories[i]) for i, p in enumerate(ROW_PARAMS)])
    processed = logits.clone()
    apply_logit_processing(processed, ROW_PARAMS, histories)
    assert torch.allclose(processed.double(), expected, atol=1e-5)
    assert torch.equal(processed[0], logits[0])  # a neutral row is untouched
    assert not torch.equal(processed[4], logits[4])


def test_penalties_change_the_greedy_choice_and_bias_can_force_or_forbid_a_token() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 2.0
    logits[:, 6] = 1.5
    rows = [
        SamplingRow(SamplingParams(temperature=0), None),
        SamplingRow(SamplingParams(temperature=0, frequency_penalty=1.0), None, history=TokenHistory([], [5])),
        SamplingRow(SamplingParams(temperature=0, logit_bias={5: -100.0, 9: 10.0}), None),
    ]
    token_ids, _ = sample(logits, rows)
    assert token_ids == [5, 6, 9]


def test_min_p_drops_tokens_below_its_share_of_the_most_likely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, min_p=0.35, seed=1)  # keeps 0.5 and 0.3 (>= 0.175)
    drawn = set()
    for seed in range(300):
        generator = torch.Generator().manual_seed(seed)
        token_ids, _ = sample(logits.clone(), [SamplingRow(params, generator)])
        drawn.add(token_ids[0])
    assert drawn == {0, 1}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {4: 101.0}}, "logit_bias"),
    ],
)
def test_sampling_params_reject_out_of_range_penalties(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_a_logit_bias_token_outside_the_vocabulary_is_refused_before_it_runs(llama_dir: Path) -> None:
    with LLM(str(llama_dir)) as llm:
        vocab = llm.engine.limits.vocab_size
        with pytest.raises(ValueError, match="logit_bias has token id"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
        with pytest.raises(ValueError, match="stop_token_ids has token id"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=[vocab + 5], min_tokens=1))
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2  # still serving


# ---------------------------------------------------------------------------- against Hugging Face


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (4, 19, 33)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_repetition_penalty_and_logit_bias_match_hugging_face(model_dirs: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)
    biased = prompts[0][0]  # a prompt token, pushed up: bias and repetition penalty both touch it
    for kwargs, hf_kwargs in [
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        (
            {"repetition_penalty": 1.3, "logit_bias": {biased: 2.5}},
            {"repetition_penalty": 1.3, "sequence_bias": [[[biased], 2.5]]},
        ),
    ]:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]
        outputs = LLM(str(model_dirs[arch])).generate(prompts, params)
        for prompt, output in zip(prompts, outputs):
            with torch.no_grad():
                sequence = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=20,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    **hf_kwargs,
                )
            assert output.token_ids == sequence[0, len(prompt) :].tolist(), kwargs


def test_frequency_and_presence_penalties_stop_a_greedy_loop(llama_dir: Path) -> None:
    prompt = [5, 6, 7] * 10
    plain = LLM(str(llama_dir)).generate([prompt], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    penalised = LLM(str(llama_dir)).generate(
        [prompt],
        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
    )
    assert len(set(penalised[0].token_ids)) > len(set(plain[0].token_ids))


# ---------------------------------------------------------------------------- with speculative decoding


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalised_requests_speculate_exactly(llama_dir: Path, temperature: float) -> None:
    """Each proposed position is penalised as if the proposals before it were output: the output equals the
    output without speculation, greedy and seeded."""
    rng = random.Random(5)
    batch = [([rng.randrange(3, 300) for _ in range(5)] * 8)[: 20 + 3 * i] for i in range(6)]
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=temperature,
            seed=11 + i,
            ignore_eos=True,
            frequency_penalty=0.7,
            presence_penalty=0.3,
            repetition_penalty=1.2,
            logit_bias={batch[i][0]: 1.5},
        )
        for i in range(len(batch))
    ]
    reference = [o.token_ids for o in LLM(str(llama_dir)).generate(batch, params)]  # type: ignore[arg-type]
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    with LLM(str(llama_dir), speculative=speculative) as llm:
        llm.engine.proposer = OracleProposer({tuple(p): r for p, r in zip(batch, reference)}, error_rate=0.3)
        outputs = [o.token_ids for o in llm.generate(batch, params)]  # type: ignore[arg-type]
        assert outputs == reference
        assert llm.engine.stats().spec_accepted_tokens > 0

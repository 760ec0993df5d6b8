"""Sampler: greedy, temperature, top-k, top-p, seeds, banned tokens, logprobs; SamplingParams checks."""

from __future__ import annotations

import math

import pytest
import torch

from kvyard.api.errors import InputError
from kvyard.engine.sampling.bad_words import bad_words_token_ids
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.sampling.sampler import SamplingRow, sample
from kvyard.engine.scheduling.request import Request


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def distinct_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits with no ties in any row (so "the top k" is well defined)."""
    generator = seeded(seed)
    return torch.stack([torch.randperm(vocab, generator=generator).float() * 0.1 for _ in range(rows)])


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n independent draws for one row, as one batch of n identical rows sharing a generator."""
    generator = seeded(seed)
    rows = [SamplingRow(params, generator) for _ in range(n)]
    token_ids, _ = sample(logits_row.expand(n, -1).clone(), rows)
    return token_ids


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 40, generator=seeded(1))
    rows = [SamplingRow(SamplingParams(temperature=0.0), None) for _ in range(6)]
    token_ids, logprobs = sample(logits.clone(), rows)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 6


def test_top_k_1_equals_greedy_at_any_temperature() -> None:
    logits = torch.randn(5, 40, generator=seeded(2))
    for temperature in (0.5, 1.0, 3.0):
        rows = [SamplingRow(SamplingParams(temperature=temperature, top_k=1), seeded(i)) for i in range(5)]
        assert sample(logits.clone(), rows)[0] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("k", [2, 3, 7])
def test_top_k_never_samples_outside_the_top_k(k: int) -> None:
    logits = distinct_logits(1, 30, seed=k)[0]
    top = set(logits.topk(k).indices.tolist())
    draws = draw_many(logits, SamplingParams(temperature=5.0, top_k=k), 600, seed=k)
    assert set(draws) <= top
    assert set(draws) == top  # high temperature: every allowed token shows up


def test_top_k_disabled_values_are_equivalent() -> None:
    logits = distinct_logits(1, 12, seed=3)[0]
    results = [draw_many(logits, SamplingParams(top_k=k, temperature=2.0), 200, seed=9) for k in (0, -1, 12)]
    assert results[0] == results[1] == results[2]
    assert len(set(results[0])) > 6


def test_small_top_p_keeps_only_the_top_token() -> None:
    logits = distinct_logits(1, 25, seed=4)[0]
    draws = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.01), 300, seed=4)
    assert set(draws) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # Mass before token 1 is 0.5 < 0.6: kept; before token 2 it is 0.8 >= 0.6: dropped.
    draws = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.6), 2000, seed=5)
    assert set(draws) == {0, 1}
    share = draws.count(0) / len(draws)
    assert abs(share - 0.5 / 0.8) < 0.05  # renormalised over the kept tokens


def test_top_k_and_top_p_in_one_mixed_batch_apply_per_row() -> None:
    vocab = 20
    logits = distinct_logits(1, vocab, seed=6)[0]
    order = logits.argsort(descending=True).tolist()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=4.0, top_k=2),
        SamplingParams(temperature=4.0, top_p=0.01),
        SamplingParams(temperature=4.0),
    ]
    copies = 150
    rows = [SamplingRow(p, seeded(6 + i)) for i in range(copies) for p in params]
    token_ids, _ = sample(logits.expand(len(rows), -1).clone(), rows)
    seen = [set(token_ids[index :: len(params)]) for index in range(len(params))]
    assert seen[0] == {order[0]}
    assert seen[1] == set(order[:2])
    assert seen[2] == {order[0]}
    assert len(seen[3]) > 5  # unrestricted row is not affected by the others' top-k / top-p


def test_top_k_larger_than_vocab_next_to_an_active_top_k() -> None:
    vocab = 8
    logits = distinct_logits(2, vocab, seed=7)
    rows = [
        SamplingRow(SamplingParams(top_k=2), seeded(0)),
        SamplingRow(SamplingParams(top_k=vocab + 10), seeded(1)),  # valid: means "no limit"
    ]
    token_ids, _ = sample(logits.clone(), rows)
    assert token_ids[0] in logits[0].topk(2).indices.tolist()
    assert 0 <= token_ids[1] < vocab


def test_top_k_larger_than_vocab_alone_is_no_limit() -> None:
    logits = distinct_logits(1, 8, seed=8)[0]
    draws = draw_many(logits, SamplingParams(temperature=5.0, top_k=50), 300, seed=8)
    assert set(draws) == set(range(8))


def _seeded_run(batch_logits: list[torch.Tensor], position: int, seed: int, extra: list[SamplingRow]) -> list[int]:
    """Sample `len(batch_logits)` steps for one seeded row placed at `position` among `extra` rows."""
    generator = seeded(seed)
    params = SamplingParams(temperature=1.3, top_p=0.95, seed=seed)
    out: list[int] = []
    for step_logits in batch_logits:
        rows = list(extra)
        rows.insert(position, SamplingRow(params, generator))
        batch = torch.randn(len(rows), step_logits.shape[0], generator=seeded(len(out) + 100))
        batch[position] = step_logits
        token_ids, _ = sample(batch, rows)
        out.append(token_ids[position])
    return out


def test_seeded_request_is_reproducible_and_independent_of_the_batch() -> None:
    vocab = 64
    steps = [torch.randn(vocab, generator=seeded(i)) * 0.5 for i in range(12)]
    alone = _seeded_run(steps, 0, seed=1234, extra=[])
    assert alone == _seeded_run(steps, 0, seed=1234, extra=[])
    assert len(set(alone)) > 4, "should actually be sampling"
    others = [
        SamplingRow(SamplingParams(temperature=0.7, top_k=5), seeded(1)),
        SamplingRow(SamplingParams(temperature=0.0), None),
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.3), seeded(2)),
        SamplingRow(SamplingParams(temperature=2.0), seeded(3)),
    ]
    for position in (0, 2, 4):
        assert _seeded_run(steps, position, seed=1234, extra=others) == alone
    assert _seeded_run(steps, 0, seed=4321, extra=[]) != alone


def test_temperature_sampling_matches_softmax_frequencies() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    n = 6000
    for temperature in (0.7, 1.0, 2.0):
        expected = torch.softmax(logits / temperature, dim=-1).tolist()
        draws = draw_many(logits, SamplingParams(temperature=temperature), n, seed=11)
        counts = [draws.count(t) for t in range(3)]
        chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected))
        assert chi2 < 20.0, (temperature, counts, expected)  # 2 d.o.f.: p ~ 5e-5


def test_logprobs_match_log_softmax_of_the_logits() -> None:
    logits = torch.randn(3, 50, generator=seeded(12))
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5), None),
        SamplingRow(SamplingParams(temperature=0.8, logprobs=0), seeded(1)),
        SamplingRow(SamplingParams(temperature=0.8), seeded(2)),
    ]
    token_ids, logprobs = sample(logits.clone(), rows)
    reference = logits.log_softmax(dim=-1)
    first, second, third = logprobs
    assert first is not None and second is not None and third is None
    assert first.token_id == token_ids[0]
    assert math.isclose(first.logprob, float(reference[0, token_ids[0]]), abs_tol=1e-5)
    top = reference[0].topk(5)
    assert list(first.top) == top.indices.tolist()
    for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
        assert math.isclose(first.top[token_id], value, abs_tol=1e-5)
    assert second.token_id == token_ids[1]
    assert math.isclose(second.logprob, float(reference[1, token_ids[1]]), abs_tol=1e-5)
    assert second.top == {}


def test_banned_tokens_are_never_sampled() -> None:
    logits = distinct_logits(1, 10, seed=13)[0]
    best = int(logits.argmax())
    greedy, _ = sample(logits[None].clone(), [SamplingRow(SamplingParams(temperature=0.0), None, (best,))])
    assert greedy[0] != best
    assert greedy[0] == int(logits.topk(2).indices[1])
    banned = (best, 0, 5)
    generator = seeded(13)
    rows = [SamplingRow(SamplingParams(temperature=3.0), generator, banned) for _ in range(500)]
    draws, _ = sample(logits.expand(500, -1).clone(), rows)
    assert not set(draws) & set(banned)
    assert len(set(draws)) == 10 - len(set(banned))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_normalises_and_classifies() -> None:
    params = SamplingParams(stop="END")  # type: ignore[arg-type]
    assert params.stop == ["END"]
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy
    SamplingParams(top_p=1.0, top_k=-1, temperature=0.0, logprobs=20, min_tokens=16)  # edges are valid


def _request(params: SamplingParams, output: list[int], bad_words: list[tuple[int, ...]]) -> Request:
    return Request(
        "r",
        [1, 2, 3],
        params,
        b"r" * 16,
        4,
        output_token_ids=output,
        stop_token_ids=frozenset({9}),
        bad_words_token_ids=bad_words,
    )


def test_bad_words_ban_their_last_token_where_the_output_ends_with_the_rest() -> None:
    words = [(5,), (7, 8), (1, 2, 3)]
    params = SamplingParams(max_tokens=8)
    assert _request(params, [], words).banned_token_ids() == {5}  # one token: always
    assert _request(params, [4, 7], words).banned_token_ids() == {5, 8}
    assert _request(params, [7, 4], words).banned_token_ids() == {5}
    assert _request(params, [1, 2], words).banned_token_ids() == {5, 3}
    assert _request(params, [2], words).banned_token_ids() == {5}  # the prompt does not count
    assert _request(params, [1], words).banned_token_ids(ahead=[2]) == {5, 3}  # after proposals being verified
    assert _request(params, [1, 2], words).banned_token_ids(ahead=[7]) == {5, 8}
    assert _request(params, [1, 2], []).banned_token_ids() == frozenset()
    with_min = SamplingParams(max_tokens=8, min_tokens=3)
    assert _request(with_min, [7, 7], words).banned_token_ids() == {5, 8, 9}  # and the stop tokens until min_tokens
    assert _request(with_min, [7], words).banned_token_ids(ahead=[7, 7]) == {5, 8}


class WordEncoder:
    """Encodes the words it knows, as a tokenizer would."""

    def __init__(self, words: dict[str, list[int]]) -> None:
        self.words = words

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.words[text]


def test_bad_words_are_tokenized_with_and_without_a_leading_space_as_vllm_does() -> None:
    encoder = WordEncoder(
        {
            "cat": [10],
            " cat": [11],
            "dog": [12, 13],
            " dog": [14, 15],
            "owl": [16, 17],
            " owl": [18],
            "emu": [19],
            " emu": [19],
            "": [],
            " ": [20],
        }
    )
    # " owl" is one token where "owl" is two: not taken (vLLM keeps only a spaced form of as many tokens); nor is
    # a spaced form that starts with the bare form's token
    assert bad_words_token_ids(["cat", " dog", "owl", "emu"], encoder, 100) == [
        (10,),
        (11,),
        (12, 13),
        (14, 15),
        (16, 17),
        (19,),
    ]
    with pytest.raises(InputError, match="bad_words: bad word ' ' has no tokens") as error:
        bad_words_token_ids([" "], encoder, 100)
    assert error.value.param == "bad_words"
    with pytest.raises(InputError, match=r"bad_words.*id 19, outside the model's vocabulary") as error:
        bad_words_token_ids(["emu"], encoder, 19)
    with pytest.raises(InputError, match=r"bad_words.*129 token sequences"):
        bad_words_token_ids(["dog"] * 64 + ["emu"], encoder, 100)


def test_bad_words_and_priority_are_type_checked() -> None:
    with pytest.raises(ValueError, match="bad_words must be strings"):
        SamplingParams(bad_words=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=True)

"""Logit biases and repetition penalties, applied to a batch of logits before a token is chosen.

The order follows vLLM's sampler: `logit_bias` first, then the repetition penalty (CTRL, Keskar et al. 2019,
as in Hugging Face's `RepetitionPenaltyLogitsProcessor`: over prompt and output tokens, a positive logit is
divided by the penalty and a negative one multiplied), then OpenAI's frequency and presence penalties (over
output tokens only: `logit -= frequency_penalty * count + presence_penalty * (count > 0)`). Temperature,
top-k and top-p come after, in the sampler. Greedy rows see the same processed logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvyard.engine.sampling.params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """The tokens a row's penalties look at: the prompt, and the output before the position sampled."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def apply_logit_processing(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]
) -> None:
    """Bias and penalise `logits` ([rows, vocab]) in place; rows whose parameters are neutral are untouched."""
    for row, row_params in enumerate(params):
        if row_params.logit_bias:
            _add_bias(logits[row], row_params.logit_bias)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        rows = torch.tensor(penalised, device=logits.device)
        rows_histories = [_history(histories[i]) for i in penalised]
        logits[rows] = _penalised(logits[rows], [params[i] for i in penalised], rows_histories)


def _history(history: TokenHistory | None) -> TokenHistory:
    if history is None:
        raise ValueError("a row with penalties needs its token history")
    return history


def _add_bias(row: torch.Tensor, logit_bias: dict[int, float]) -> None:
    token_ids = torch.tensor(list(logit_bias), device=row.device)
    row[token_ids] += torch.tensor(list(logit_bias.values()), dtype=row.dtype, device=row.device)


def _penalised(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    counts = torch.stack([_token_counts(h.output_token_ids, vocab_size, logits.device) for h in histories])
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=logits.device)
    if bool((repetition != 1).any()):
        seen = counts > 0
        for row, history in enumerate(histories):
            if history.prompt_token_ids:
                seen[row, torch.tensor(list(history.prompt_token_ids), device=logits.device)] = True
        penalty = repetition[:, None]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=logits.device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=logits.device)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def _token_counts(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    if not token_ids:
        return torch.zeros(vocab_size, dtype=torch.float32, device=device)
    ids = torch.tensor(list(token_ids), device=device)
    return torch.bincount(ids, minlength=vocab_size).to(torch.float32)

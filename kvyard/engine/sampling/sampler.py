"""Turn a batch of logits into next tokens: biases and penalties, greedy, temperature, top-k, top-p, seeds,
logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvyard.engine.sampling.logprobs import TokenLogprobs
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.sampling.penalties import TokenHistory, apply_logit_processing


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS before min_tokens is reached
    history: TokenHistory | None = None  # needed when the params have penalties
    allowed_tokens: torch.Tensor | None = None  # bool [vocab]: the only tokens a grammar allows next


Argmax = Callable[[torch.Tensor], torch.Tensor]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], argmax: Argmax = torch_argmax
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [len(rows), vocab] float32. Returns the sampled ids and, per row, logprobs if asked.

    `argmax` picks the greedy tokens (a native kernel on CPU: torch's takes ~3% of a 64-sequence decode step).
    Logprobs are those of the biased and penalised logits, before temperature, top-k and top-p."""
    constrained = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
    if constrained:
        allowed = torch.stack([rows[i].allowed_tokens for i in constrained])  # type: ignore[misc]
        constrained_rows = torch.tensor(constrained, device=logits.device)
        logits[constrained_rows] = logits[constrained_rows].masked_fill(~allowed.to(logits.device), float("-inf"))
    apply_logit_processing(logits, [row.params for row in rows], [row.history for row in rows])
    for index, row in enumerate(rows):
        if row.banned_token_ids:
            logits[index, list(row.banned_token_ids)] = float("-inf")
    token_ids = _choose_tokens(logits, rows, argmax)
    return token_ids.tolist(), _logprobs(logits, token_ids, rows)


def _choose_tokens(logits: torch.Tensor, rows: list[SamplingRow], argmax: Argmax) -> torch.Tensor:
    token_ids = argmax(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = _processed_probs(logits[index], [rows[i].params for i in random_rows])
        token_ids[index] = _draw(probs, [rows[i].generator for i in random_rows])
    return token_ids


def _processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temperatures[:, None]
    vocab_size = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if min(top_ks) < vocab_size:
        logits = _apply_top_k(logits, top_ks)
    top_ps = torch.tensor([p.top_p for p in params], device=logits.device)
    if bool((top_ps < 1).any()):
        logits = _apply_top_p(logits, top_ps)
    probs = logits.softmax(dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=logits.device)
    if bool((min_ps > 0).any()):  # the most likely token always passes: it holds max_prob >= min_p * max_prob
        probs = probs.masked_fill(probs < min_ps[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    ks = torch.tensor(top_ks, device=logits.device)
    top_values = logits.topk(max(top_ks), dim=-1).values
    thresholds = top_values.gather(1, (ks - 1).clamp(max=top_values.shape[1] - 1)[:, None])
    return logits.masked_fill(logits < thresholds, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the probability mass strictly before it already reaches top_p;
    # the most likely token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample by the exponential-race trick: argmax(p / E) with E ~ Exp(1) is a draw from p."""
    noise = torch.empty_like(probs)
    for index, generator in enumerate(generators):
        noise[index].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    log_probs = logits[wanted].log_softmax(dim=-1)
    for position, index in enumerate(wanted):
        token_id = int(token_ids[index])
        num_top = rows[index].params.logprobs or 0
        top = log_probs[position].topk(num_top) if num_top else None
        result[index] = TokenLogprobs(
            token_id=token_id,
            logprob=float(log_probs[position, token_id]),
            top=dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {},
        )
    return result

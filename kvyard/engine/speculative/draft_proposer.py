"""Speculative proposals from a smaller checkpoint with the served model's vocabulary (`draft`), run greedily on
a paged KV cache of its own; and the loading of every proposing model (`draft`, and the served model's own weights
converted to int8 or fp16 for `self-int8` / `self-fp16`, which kvyard.engine.speculative.self_draft runs over the served
model's cache).

Each step, every request that may speculate first brings the draft up to date with its tokens: the tokens the
draft has not seen yet (a new request's prompt, over several steps when it is long; else the tokens the target
emitted last step) go through the draft in one batched pass whose last position gives the first guess. Each
further guess is one more single-token pass over all the requests still guessing. The draft keeps the KV of the
guesses it was fed; next step, those the target accepted are already computed, and the rest are overwritten.

The draft's KV blocks are its own: as many as the target's pool, allocated per request as its context grows, and
taken back from the requests least recently served when they run out (a request without room does not guess
this step). Greedy guesses suit sampled requests too: the runner keeps a point guess with the target's own
probability of it (`speculative`), so what is emitted follows the target's distribution whatever proposes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvyard.engine.runners.model_runner import PagedModel
from kvyard.engine.scheduling.request import Request
from kvyard.engine.speculative.draft_passes import DraftPasses
from kvyard.models.config import ModelConfig, load_model_config
from kvyard.models.decoder import CausalLM
from kvyard.models.loader import load_model
from kvyard.models.package import is_package, load_package
from kvyard.models.quantization import quantize_model


class DraftModelError(ValueError):
    """The draft cannot propose for this model (other vocabulary, shorter context, ...): said before serving."""


@dataclass(slots=True)
class _DraftSequence:
    """The draft's view of one request: its KV blocks and how many of the request's tokens they hold."""

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of the request whose draft KV is right
    fed_guesses: list[int] = field(default_factory=list)  # guesses whose KV follows those, from the last step
    last_step: int = 0  # the proposer step that last used it (eviction order)


@dataclass(slots=True)
class _Query:
    """One request's tokens in one draft pass."""

    sequence: _DraftSequence
    token_ids: list[int]
    start: int  # position of the first of them
    wants_guess: bool


class DraftModelProposer:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
        max_catch_up: int = 512,
        kv_cache_dtype: str = "auto",
    ) -> None:
        dtype = next(model.parameters()).dtype
        self.passes = DraftPasses(
            PagedModel(model, num_blocks, block_size, dtype, device, attention_backend, kv_cache_dtype)
        )
        self.block_size = block_size
        self.max_catch_up = max_catch_up
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._sequences: dict[str, _DraftSequence] = {}
        self._step = 0
        self.passes.warm_up(self._free_blocks[::-1])  # nothing is cached yet: any block may be overwritten

    def seconds_per_proposal(self, num_sequences: int) -> float:
        return self.passes.seconds_per_proposal(num_sequences)

    def release(self, request: Request) -> None:
        sequence = self._sequences.pop(request.request_id, None)
        if sequence is not None:
            self._free_blocks.extend(reversed(sequence.block_table))

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        self._step += 1
        guesses: list[list[int]] = [[] for _ in requests]
        queries: list[tuple[int, _Query]] = []
        budget = self.max_catch_up
        for index, (request, room) in enumerate(zip(requests, rooms)):
            if room <= 0:
                continue
            query = self._catch_up_query(request, room, budget)
            if query is not None:
                budget -= len(query.token_ids) - 1
                queries.append((index, query))
        queries.sort(key=lambda item: len(item[1].token_ids) != 1)  # single-token queries first
        first = self._run_pass([query for _, query in queries])
        guessing = [(index, query.sequence) for index, query in queries if query.wants_guess]
        for (index, _), token_id in zip(guessing, first):
            guesses[index].append(token_id)
        for ahead in range(1, max((rooms[index] for index, _ in guessing), default=0)):
            guessing = [(index, sequence) for index, sequence in guessing if rooms[index] > ahead]
            step = [
                _Query(sequence, [guesses[index][-1]], sequence.num_computed + ahead - 1, True)
                for index, sequence in guessing
            ]
            for (index, sequence), token_id in zip(guessing, self._run_pass(step, guessing=True)):
                sequence.fed_guesses.append(guesses[index][-1])
                guesses[index].append(token_id)
        return guesses

    def _catch_up_query(self, request: Request, room: int, budget: int) -> _Query | None:
        """The request's tokens the draft has not computed (at least its last one, whose logits give the first
        guess), with blocks for them and `room` guesses; None when the draft has no blocks for it."""
        sequence = self._sequences.setdefault(request.request_id, _DraftSequence())
        sequence.last_step = self._step
        tokens = request.all_token_ids
        matched = 0
        for guess, token_id in zip(sequence.fed_guesses, tokens[sequence.num_computed :]):
            if guess != token_id:
                break
            matched += 1
        start = min(sequence.num_computed + matched, len(tokens) - 1)
        sequence.fed_guesses = []
        sequence.num_computed = start
        new_tokens = tokens[start:]
        wants_guess = len(new_tokens) - 1 <= budget
        if not wants_guess:  # a long prompt: prefill part of it now, guess in a later step
            new_tokens = new_tokens[: max(budget, 1)]
        if not self._reserve(sequence, start + len(new_tokens) + (room - 1 if wants_guess else 0)):
            return None
        return _Query(sequence, new_tokens, start, wants_guess)

    def _reserve(self, sequence: _DraftSequence, num_positions: int) -> bool:
        """Blocks for `num_positions` positions, taken from the least recently served requests if need be."""
        needed = -(-num_positions // self.block_size) - len(sequence.block_table)
        if needed > len(self._free_blocks):
            self._evict(needed - len(self._free_blocks))
        if needed > len(self._free_blocks):
            return False
        for _ in range(max(needed, 0)):
            sequence.block_table.append(self._free_blocks.pop())
        return True

    def _evict(self, num_blocks: int) -> None:
        idle = sorted((s for s in self._sequences.items() if s[1].last_step < self._step), key=lambda s: s[1].last_step)
        for request_id, sequence in idle:
            if num_blocks <= 0:
                return
            num_blocks -= len(sequence.block_table)
            self._free_blocks.extend(reversed(sequence.block_table))
            del self._sequences[request_id]

    def _run_pass(self, queries: Sequence[_Query], guessing: bool = False) -> list[int]:
        """One forward pass of the draft over `queries` (single-token ones first); returns the greedy next token
        of each query that wants a guess, in order. A catch-up pass (not `guessing`) advances what each sequence
        holds; a guessing pass feeds guesses, whose KV counts only once the target accepts them."""
        token_ids = self.passes.run(
            [query.token_ids for query in queries],
            [query.start for query in queries],
            [query.sequence.block_table for query in queries],
            [query.wants_guess for query in queries],
        )
        if not guessing:
            for query in queries:
                query.sequence.num_computed = query.start + len(query.token_ids)
        return token_ids


def load_draft_model(
    method: str,
    draft_dir: str | None,
    target_dir: str,
    target: ModelConfig,
    target_quantization: str,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    tokenizers: tuple[Any, Any] = (None, None),
) -> CausalLM:
    """The model that proposes: `self-int8` / `self-fp16` convert the target's own checkpoint; `draft` loads
    `draft_dir`, after checking that it shares the target's vocabulary (`tokenizers`: the target's and the draft's,
    None where a directory has none) and covers its context."""
    if method.startswith("self-"):
        scheme = method.removeprefix("self-")
        if is_package(target_dir) or target_quantization != "none":
            raise DraftModelError(
                f"--speculative {method} drafts with the model's own weights converted to "
                f"{scheme}, but the model already runs converted weights: serve the checkpoint "
                "as stored, or use ngram or draft"
            )
        model = load_model(target_dir, dtype, device, max_model_len, target)
        quantize_model(model, scheme)
        return model
    if draft_dir is None or not (Path(draft_dir) / "config.json").is_file():
        raise DraftModelError(f"--draft-model {draft_dir}: no config.json there; give a Hugging Face model directory")
    draft = load_model_config(draft_dir)
    _check_vocabulary(target, draft, draft_dir, *tokenizers)
    if draft.max_position_embeddings < max_model_len:
        raise DraftModelError(
            f"--draft-model {draft_dir} covers {draft.max_position_embeddings} positions, fewer "
            f"than the served context of {max_model_len}: serve with --max-model-len "
            f"{draft.max_position_embeddings} or less"
        )
    if is_package(draft_dir):
        return load_package(draft_dir, dtype, device, max_model_len)
    return load_model(draft_dir, dtype, device, max_model_len, draft)


def _check_vocabulary(target: ModelConfig, draft: ModelConfig, draft_dir: str, target_tok: Any, draft_tok: Any) -> None:
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(
            f"--draft-model {draft_dir} has a vocabulary of {draft.vocab_size} tokens, the served "
            f"model {target.vocab_size}: a draft must share the model's tokenizer"
        )
    if (target_tok is None) != (draft_tok is None):
        raise DraftModelError(
            f"--draft-model {draft_dir}: only one of the draft and the served model has "
            "tokenizer files, so they cannot be checked to share a tokenizer"
        )
    if target_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise DraftModelError(
            f"--draft-model {draft_dir}: its tokenizer maps tokens to other ids than the served "
            "model's; a draft must share the model's tokenizer"
        )

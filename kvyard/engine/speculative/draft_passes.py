"""A proposing model's greedy forward passes over a paged KV cache, timed.

Both model proposers run their model through this: `draft_proposer` (a draft on a cache of its own) and
`self_draft` (the served model's converted weights over the served model's cache). A pass of at most
`NATIVE_PASS_ROWS` tokens runs on the native kernels where they can run it
(kvyard.engine.speculative.native_draft), a longer one, or one on another device, through the PyTorch modules.
Passes of one or two tokens per sequence are timed: what one more guess costs a step, for the engine's choice of
how many tokens to propose.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvyard.engine.runners.model_runner import PagedModel
from kvyard.engine.speculative.native_draft import NativeGuesser
from kvyard.engine.speculative.policy import StepCost

WARM_UP_BATCHES = (1, 2, 4, 8, 16, 1, 4)  # sequences in the passes that seed the pass-cost fit
WARM_UP_BLOCKS = max(WARM_UP_BATCHES)  # one block a sequence
# Rows a pass may have to run on the native kernels (beyond: the modules, whose matmul of many rows is faster).
NATIVE_PASS_ROWS = 64


class DraftPasses:
    def __init__(self, paged: PagedModel) -> None:
        self.paged = paged
        self.native = NativeGuesser.of(paged)  # passes without Python per layer, where it can run
        self.cost = StepCost()  # seconds of a pass of one or two tokens per sequence, against sequences

    def seconds_per_proposal(self, num_sequences: int) -> float:
        return self.cost.step_seconds(num_sequences) or 0.0

    @torch.inference_mode()
    def warm_up(self, blocks: Sequence[int]) -> None:
        """Single-token passes over 1 to 16 sequences of one of `blocks` each (WARM_UP_BLOCKS blocks whose contents
        may be overwritten; fewer: no warm-up), so the first real steps price a guess at what a pass of their size
        costs; the first, cold pass is not counted."""
        tables = [[block] for block in blocks[:WARM_UP_BLOCKS]]
        if len(tables) < WARM_UP_BLOCKS:
            return
        self.run([[0]], [0], tables[:1], [True])
        self.cost = StepCost()
        for position, num_sequences in enumerate(WARM_UP_BATCHES):
            self.run([[0]] * num_sequences, [position] * num_sequences, tables[:num_sequences], [True] * num_sequences)

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[list[int]],
        starts: Sequence[int],
        block_tables: Sequence[list[int]],
        wants_guess: Sequence[bool],
    ) -> list[int]:
        """One pass over queries, single-token ones first: query i feeds `token_ids[i]` from position `starts[i]`
        through the blocks of `block_tables[i]` (their KV written there); returns the greedy next token of each
        query that wants a guess, in order."""
        if not token_ids:
            return []
        started = time.perf_counter()
        if self.native is not None and sum(len(tokens) for tokens in token_ids) <= NATIVE_PASS_ROWS:
            guesses = self.native.run_pass(token_ids, starts, block_tables, wants_guess)
        else:
            guesses = self._module_pass(token_ids, starts, block_tables, wants_guess)
        if max(len(tokens) for tokens in token_ids) <= 2:
            self.cost.observe(len(token_ids), time.perf_counter() - started)
        return guesses

    def _module_pass(
        self,
        token_ids: Sequence[list[int]],
        starts: Sequence[int],
        block_tables: Sequence[list[int]],
        wants_guess: Sequence[bool],
    ) -> list[int]:
        """The pass through the PyTorch modules (PagedModel)."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for tokens, start, guess in zip(token_ids, starts, wants_guess, strict=True):
            input_ids += tokens
            positions += range(start, start + len(tokens))
            if guess:
                rows.append(len(input_ids) - 1)
        hidden = self.paged.run(
            input_ids,
            positions,
            block_tables=list(block_tables),
            context_lens=[start + len(tokens) for tokens, start in zip(token_ids, starts)],
            query_lens=[len(tokens) for tokens in token_ids],
        )
        if not rows:
            return []
        logits = self.paged.model.compute_logits(hidden[torch.tensor(rows, device=self.paged.device)])
        guesses: list[int] = logits.argmax(dim=-1).tolist()
        return guesses

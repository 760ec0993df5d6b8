"""`self-int8` / `self-fp16`: the served model's own weights, converted, guessing over the served model's KV cache.

A self-draft has the served model's layers, so the keys and values the served model computed are what its own
would be, only more precise. It reads them from the served model's cache for every position already computed: it
has no prompt to catch up on, no KV memory of its own and nothing to keep across steps. After a prompt of thousands
of tokens, a prefix-cache hit, blocks loaded from the KV tier or pulled from a prefill replica, the draft guesses
from the first decode step on.

It must never write there, though: the served model's blocks are shared with other requests and the prefix cache.
Each step, every guessing request borrows a few free blocks of the served model's pool (taken as any allocation
takes them) for the positions the draft writes, its last token and its guesses: a copy of the request's partial
last block, then blocks for the positions after it. Its draft table is the request's full blocks, then those. The
borrowed blocks go back to the pool at the end of the step, before the scheduler allocates. A request for which
the pool has no free blocks does not guess this step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvyard.engine.runners.model_runner import PagedModel
from kvyard.engine.scheduling.block_pool import BlockPool
from kvyard.engine.scheduling.request import Request
from kvyard.engine.speculative.draft_passes import WARM_UP_BLOCKS, DraftPasses
from kvyard.models.decoder import CausalLM


@dataclass(slots=True)
class _Guessing:
    """One request's guessing this step: where it is in the `guesses` list, its draft block table, how many
    guesses it may make, and the blocks it borrowed."""

    index: int
    block_table: list[int]
    start: int  # position of the request's last token, the first the draft computes
    room: int
    borrowed: list[int]


class SelfDraftProposer:
    def __init__(self, model: CausalLM, target: PagedModel) -> None:
        """`model`: the served model with converted weights; `target`: the served model's PagedModel, whose cache
        and block size it uses."""
        self.passes = DraftPasses(
            PagedModel(
                model,
                target.num_blocks,
                target.block_size,
                target.dtype,
                target.device,
                target.attention_backend.name,
                target.kv_format.name,
                kv_caches=target.kv_caches,
            )
        )
        self.block_size = target.block_size
        self.pool: BlockPool | None = None

    def use_block_pool(self, pool: BlockPool) -> None:
        """The served model's block pool, to borrow from; a fresh one (nothing cached), so warm-up passes may write
        into its blocks."""
        self.pool = pool
        borrowed = pool.allocate(min(WARM_UP_BLOCKS, pool.num_free_blocks))
        try:
            self.passes.warm_up(borrowed)
        finally:
            pool.free(borrowed)

    def seconds_per_proposal(self, num_sequences: int) -> float:
        return self.passes.seconds_per_proposal(num_sequences)

    def release(self, request: Request) -> None:
        """Nothing is kept for a request between steps."""

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in requests]
        borrowing = [
            item
            for index, (request, room) in enumerate(zip(requests, rooms))
            if room > 0 and (item := self._borrow(index, request, room)) is not None
        ]
        try:
            self._copy_partial_blocks(borrowing, requests)
            for ahead in range(max((item.room for item in borrowing), default=0)):
                # each pass feeds what the last one guessed; the first, the request's last token
                guessing = [item for item in borrowing if item.room > ahead]
                tokens = [guesses[item.index][-1:] or requests[item.index].all_token_ids[-1:] for item in guessing]
                passed = self.passes.run(
                    tokens,
                    [item.start + ahead for item in guessing],
                    [item.block_table for item in guessing],
                    [True] * len(guessing),
                )
                for item, token_id in zip(guessing, passed, strict=True):
                    guesses[item.index].append(token_id)
        finally:
            self._give_back(borrowing)
        return guesses

    def _borrow(self, index: int, request: Request, room: int) -> _Guessing | None:
        """Blocks for the positions the draft writes for `request` (its last token, then `room - 1` guesses);
        None when the pool has not that many free."""
        assert self.pool is not None, "use_block_pool first"
        start = request.num_computed_tokens  # can_speculate: the request's one token not computed yet
        first_block, last_block = start // self.block_size, (start + room - 1) // self.block_size
        needed = last_block - first_block + 1
        if needed > self.pool.num_free_blocks:
            return None
        borrowed = self.pool.allocate(needed)
        return _Guessing(index, request.block_table[:first_block] + borrowed, start, room, borrowed)

    def _copy_partial_blocks(self, guessing: Sequence[_Guessing], requests: Sequence[Request]) -> None:
        """Copy the computed positions of each request's partial last block into its first borrowed block."""
        sources: list[int] = []
        destinations: list[int] = []
        for item in guessing:
            num_partial = item.start % self.block_size
            if num_partial:
                source = requests[item.index].block_table[item.start // self.block_size] * self.block_size
                sources += range(source, source + num_partial)
                destinations += range(
                    item.borrowed[0] * self.block_size, item.borrowed[0] * self.block_size + num_partial
                )
        if not sources:
            return
        device = self.passes.paged.device
        source_slots = torch.tensor(sources, device=device)
        destination_slots = torch.tensor(destinations, device=device)
        for cache in self.passes.paged.kv_caches:  # [2, slots, kv heads, row]
            cache.index_copy_(1, destination_slots, cache.index_select(1, source_slots))

    def _give_back(self, guessing: Sequence[_Guessing]) -> None:
        assert self.pool is not None
        for item in guessing:
            self.pool.free(item.borrowed)

"""A draft model's passes on the native kernels, with no Python per layer.

A guessing pass of a draft (one token per sequence, greedy) is short: on the bench model's int8 self-draft about
1.7 ms of kernels, to which running it through the PyTorch modules added about 1.2 ms of Python (metadata
tensors, argument checks, a dozen calls from Python beside the fused layer calls). Here the pass runs through
kvyard.models.native_model over numpy views of the draft's own tensors and KV cache: the same kernels on the same
memory, so its guesses are the ones the modules give. For a guessing pass the arguments of every native call are
built once per batch of sequences and block tables, and a further pass only moves positions, slots and context
lengths on; a catch-up pass (the tokens the target emitted last step, a short prompt) is built each time."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from kvyard.engine.runners.model_runner import PagedModel
from kvyard.models.native_model import (
    BF16_KIND,
    FP16_KIND,
    KV_CODES_BY_ELEMENT,
    KVPointers,
    NativeModel,
    NativeStep,
    PreparedStep,
    kernel_functions,
)
from kvyard.models.screened_head import ScreenedHead

# Blocks a prepared guessing pass's tables may grow by before its arguments are built again.
TABLE_HEADROOM_BLOCKS = 8


class NativeGuesser:
    def __init__(self, native: NativeModel, kv: KVPointers, block_size: int) -> None:
        self.native = native
        self.kv = kv
        self.block_size = block_size
        head = native.lm_head
        # a 16-bit head's argmax, found mostly from an int8 copy of it (the same tokens, fewer bytes read)
        is_16_bit = head.kind in (FP16_KIND, BF16_KIND)
        self.screened_head = ScreenedHead.of(head.weight, head.kind == BF16_KIND) if is_16_bit else None
        self._tables_key: tuple[tuple[int, ...], ...] = ()
        self._prepared: PreparedStep | None = None

    @classmethod
    def of(cls, paged: PagedModel) -> NativeGuesser | None:
        """For a draft on the CPU fast paths with its fused few-rows path (None otherwise: PyTorch runs it)."""
        model = paged.model
        if model.fused_decode is None or paged.kernels is None or paged.attention_backend.name != "native":
            return None
        tensors = {name: _numpy_view(tensor) for name, tensor in model.state_dict().items()}
        bf16 = any(tensor.dtype == torch.bfloat16 for tensor in model.state_dict().values())
        native = NativeModel(
            model.config,
            tensors,
            "bf16" if bf16 else "int8",
            model.rotary.max_positions,
            kernel_functions(),
            paged.kernels.decode_layer.num_threads,
        )
        caches = paged.kv_caches
        layers = [(cache.data_ptr(), cache.data_ptr() + cache.stride(0) * cache.element_size()) for cache in caches]
        code = KV_CODES_BY_ELEMENT[str(caches[0].dtype).removeprefix("torch.")]
        kv = KVPointers(layers, caches[0].stride(1) * caches[0].element_size(), code)
        return cls(native, kv, paged.block_size)

    def run_pass(
        self,
        token_ids: Sequence[list[int]],
        starts: Sequence[int],
        block_tables: Sequence[list[int]],
        wants_guess: Sequence[bool],
    ) -> list[int]:
        """One pass over queries (single-token ones first): query i feeds `token_ids[i]` from position `starts[i]`
        (their KV written); the greedy next token of each query that wants a guess, in order."""
        if all(len(tokens) == 1 for tokens in token_ids) and all(wants_guess):
            return self._guess([tokens[0] for tokens in token_ids], starts, block_tables)
        step = NativeStep.of_queries(starts, [len(tokens) for tokens in token_ids], block_tables, self.block_size)
        hidden = self.native.prepare(step, self.kv).run(np.fromiter(chain.from_iterable(token_ids), dtype=np.int64))
        last_rows = np.cumsum([len(tokens) for tokens in token_ids]) - 1
        rows = last_rows[np.asarray(wants_guess, dtype=bool)]
        if rows.shape[0] == 0:
            return []
        return self._greedy_tokens(hidden[rows])

    def _guess(
        self, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[list[int]]
    ) -> list[int]:
        """A guessing pass (one token a sequence): the prepared step of these block tables, moved on."""
        prepared = self._prepared_for(block_tables)
        step = prepared.step
        step.positions[:] = positions
        np.add(step.positions, 1, out=step.context_lens)
        rows = np.arange(len(positions))
        step.slots[:] = step.block_tables[rows, step.positions // self.block_size] * self.block_size + (
            step.positions % self.block_size
        )
        hidden = prepared.run(np.asarray(token_ids, dtype=np.int64))
        return self._greedy_tokens(hidden)

    def _greedy_tokens(self, hidden: np.ndarray) -> list[int]:
        """The draft's guess after each row of final hidden states: its LM head's argmax."""
        if self.screened_head is not None:
            tokens = self.screened_head.argmax(hidden, self.native.functions, self.native.num_threads)
        else:
            tokens = self.native.argmax(self.native.logits(hidden))
        return [int(token_id) for token_id in tokens]

    def _prepared_for(self, block_tables: Sequence[list[int]]) -> PreparedStep:
        """The prepared pass of these sequences: its block tables rewritten in place when they changed, the whole
        pass built again only for another number of sequences or a table past the width it was built with."""
        key = tuple(tuple(table) for table in block_tables)
        if self._prepared is not None and key == self._tables_key:
            return self._prepared
        width = max(len(table) for table in block_tables)
        prepared = self._prepared
        built_rows, built_width = (0, 0) if prepared is None else prepared.step.block_tables.shape
        if prepared is not None and built_rows == len(block_tables) and built_width >= width:
            for row, table in zip(prepared.step.block_tables, block_tables, strict=True):
                row[: len(table)] = table
                row[len(table) :] = 0
        else:
            # positions, slots and context lengths are set by each pass (_guess); padding (block 0, never read
            # past a context length) leaves room for the tables to grow before the pass is built again
            padded = [[*table, *[0] * (width + TABLE_HEADROOM_BLOCKS - len(table))] for table in block_tables]
            step = NativeStep.of_queries([0] * len(padded), [1] * len(padded), padded, self.block_size)
            prepared = self._prepared = self.native.prepare(step, self.kv)
        self._tables_key = key
        return prepared


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a numpy array (bfloat16 as its 16-bit patterns, uint16)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()

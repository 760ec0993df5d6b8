"""The runner of the fast-start engine: a step computed by kvyard.models.native_model, tokens sampled in numpy.

It runs what the PyTorch runner runs for requests whose sampling it reproduces: greedy (by the same argmax
kernel) and unseeded temperature / top-k / top-p / min-p sampling, with EOS banned before `min_tokens`. A
request that asks for more (a seed, penalties, a logit bias, logprobs, prompt logprobs, a grammar) waits for the
PyTorch engine (`runs_natively`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest
from kvyard.engine.scheduling.step import SampledToken
from kvyard.models.native_model import (
    KV_STORAGE,
    KVPointers,
    NativeModel,
    NativeStep,
    kv_cache_buffers,
    kv_cache_views,
)

PIECE_ROWS = 64  # prompt rows per native call: the int8 kernels' few-rows range (Int8Linear.max_small_rows)


def runs_natively(params: SamplingParams) -> bool:
    """Whether the native runner samples these params as the PyTorch runner does (else the request waits)."""
    unseeded = params.is_greedy or params.seed is None
    return (
        unseeded
        and not params.has_penalties
        and not params.logit_bias
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.structured is None
    )


class NativeRunner:
    def __init__(self, model: NativeModel, num_blocks: int, block_size: int, kv_name: str) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_buffers = kv_cache_buffers(model.config, num_blocks, block_size, kv_name)
        self.kv_caches = kv_cache_views(self.kv_buffers, model.config, kv_name)
        self.kv = KVPointers.of_arrays(self.kv_caches, KV_STORAGE[kv_name][1])
        self.rng = np.random.default_rng()

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        if any(item.spec_token_ids or item.request.needs_prompt_logprobs or item.request.pooling for item in scheduled):
            raise ValueError("the native runner does not speculate, score prompts or pool them")
        decodes = [item for item in scheduled if item.num_new_tokens == 1]
        chunks = [item for item in scheduled if item.num_new_tokens > 1]
        sampled: list[tuple[Request, np.ndarray]] = []
        if decodes:
            hidden = self._run_decodes(decodes)
            sampled += [(item.request, hidden[row]) for row, item in enumerate(decodes) if item.completes_sequence]
        for item in chunks:
            last = self._run_chunk(item)
            if item.completes_sequence:
                sampled.append((item.request, last))
        if not sampled:
            return []
        logits = self.model.logits(np.stack([hidden for _, hidden in sampled]))
        return [
            SampledToken(request, token_id)
            for (request, _), token_id in zip(sampled, self._sample(logits, [request for request, _ in sampled]))
        ]

    def release(self, request: Request) -> None:
        pass

    def _run_decodes(self, decodes: list[ScheduledRequest]) -> np.ndarray:
        starts = [item.request.num_computed_tokens for item in decodes]
        step = NativeStep.of_queries(
            starts, [1] * len(decodes), [item.request.block_table for item in decodes], self.block_size
        )
        input_ids = np.array([item.request.all_token_ids[start] for item, start in zip(decodes, starts)])
        return self.model.forward(input_ids, step, self.kv)

    def _run_chunk(self, item: ScheduledRequest) -> np.ndarray:
        """Run a prompt chunk in pieces of PIECE_ROWS, each reading the earlier ones' keys from the cache; the
        final hidden state of its last token."""
        request = item.request
        start, end = request.num_computed_tokens, request.num_computed_tokens + item.num_new_tokens
        hidden = np.empty(0, dtype=np.float32)
        for first in range(start, end, PIECE_ROWS):
            count = min(PIECE_ROWS, end - first)
            step = NativeStep.of_queries([first], [count], [request.block_table], self.block_size)
            input_ids = np.array(request.all_token_ids[first : first + count], dtype=np.int64)
            hidden = self.model.forward(input_ids, step, self.kv)[-1]
        return hidden

    def _sample(self, logits: np.ndarray, requests: list[Request]) -> list[int]:
        for row, request in enumerate(requests):
            banned = list(request.banned_token_ids())
            if banned:
                logits[row, banned] = -np.inf
        token_ids = self.model.argmax(logits)
        for row, request in enumerate(requests):
            if not request.sampling_params.is_greedy:
                token_ids[row] = self._draw(logits[row], request.sampling_params)
        return [int(token_id) for token_id in token_ids]

    def _draw(self, logits: np.ndarray, params: SamplingParams) -> int:
        """A draw from the processed distribution, as kvyard.engine.sampling.sampler processes it: temperature, then
        top-k, then top-p over what is left, then min-p."""
        scaled = logits.astype(np.float64) / params.temperature
        if 0 < params.top_k < scaled.shape[0]:
            threshold = np.partition(scaled, -params.top_k)[-params.top_k]
            scaled[scaled < threshold] = -np.inf
        if params.top_p < 1:
            order = np.argsort(-scaled, kind="stable")
            probs = _softmax(scaled[order])
            mass_before = np.cumsum(probs) - probs
            scaled[order[mass_before >= params.top_p]] = -np.inf
        probs = _softmax(scaled)
        if params.min_p > 0:
            probs[probs < params.min_p * probs.max()] = 0.0
        return int(self.rng.choice(probs.shape[0], p=probs / probs.sum()))


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max())
    return shifted / shifted.sum()

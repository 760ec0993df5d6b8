"""Owns the model and its paged KV cache; turns a scheduled batch into sampled tokens."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from kvyard.engine.blend.settings import BlendSettings
from kvyard.engine.pooling.pooler import PromptPooler, choice_score
from kvyard.engine.runners.blend_prefill import blend_prefill
from kvyard.engine.sampling.logprobs import TokenLogprobs
from kvyard.engine.sampling.penalties import TokenHistory
from kvyard.engine.sampling.sampler import Argmax, SamplingRow, sample, torch_argmax
from kvyard.engine.sampling.structured_output import GrammarMatcher, allowed_tokens
from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest
from kvyard.engine.scheduling.step import SampledToken
from kvyard.models.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from kvyard.models.attention_backends import CPUNativeBackend, select_attention_backend
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import CausalLM
from kvyard.models.kv_format import KVFormat
from kvyard.models.quantization import cpu_has_fast_bf16


def zeroed_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, buffer: Any | None = None
) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU an anonymous memory mapping: the OS hands out zeroed pages as they
    are first written, so a large pool costs neither start-up time nor resident memory before it is used.
    `buffer`: CPU memory to view instead (a fast-start engine's cache, with what it holds), of exactly that size."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    memory = mmap.mmap(-1, num_bytes) if buffer is None else buffer
    if len(memory) != num_bytes:
        raise ValueError(f"a KV cache of shape {shape} and dtype {dtype} takes {num_bytes} bytes, not {len(memory)}")
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def kv_block_bytes(config: ModelConfig, block_size: int, kv_format: KVFormat) -> int:
    return (
        config.kv_planes * config.num_layers * block_size * config.num_kv_heads * kv_format.row_bytes(config.head_dim)
    )


@dataclass(slots=True)
class BatchLogits:
    """Logits for the scheduled requests that sample this step, in `sampling` order: one row each, and one per
    proposed token more for a speculating request; and the results of pooling requests whose prompt is done."""

    logits: torch.Tensor
    sampling: list[ScheduledRequest]
    pooled: list[SampledToken] = field(default_factory=list)


PROMPT_SCORING_ROWS = 256  # prompt positions turned into logits at once (each row is a vocabulary of floats)
_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: positions of one seed never reach another choice's seed (seed + i)


class PagedModel:
    """A model with its paged KV cache and the attention backend chosen for it: forward passes over a flat batch
    of tokens from many sequences. The engine's runner is one; a draft model that proposes tokens has its own."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        bf16_matmul: bool = False,
        kv_buffers: Sequence[Any] | None = None,
        kv_caches: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """`dtype`: the model's. `attention_backend`: "torch" (PyTorch SDPA, and no native code at all),
        "native" (the native CPU kernels for attention and the layers' fast paths; fp32 CPU only, else an error
        saying why), or "auto" (native where it can run, else torch). Chosen here, once:
        `self.attention_backend.name`. `kv_cache_dtype`: the cache's format (`kv_format`; auto: `dtype`).
        `bf16_matmul`: fp32, int8 and bf16 layers multiply many rows in bf16 (quantization.matmul_in_bf16).
        `kv_buffers`: one CPU buffer per layer to hold its cache (see zeroed_cache); None: allocated here.
        `kv_caches`: another PagedModel's caches, of this model's layout, to run over instead of caches of its own
        (a self-draft reads its target's KV)."""
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_format = KVFormat.resolve(kv_cache_dtype, dtype)
        config = model.config
        shape = (
            config.kv_planes,
            num_blocks * block_size,
            config.num_kv_heads,
            self.kv_format.row_width(config.head_dim),
        )
        # Zeroed, not empty: padded decode slots read block 0 and must never hold NaNs.
        storage = self.kv_format.storage_dtype
        buffers = kv_buffers if kv_buffers is not None else [None] * config.num_layers
        if len(buffers) != config.num_layers:
            raise ValueError(f"{len(buffers)} KV buffers for {config.num_layers} layers")
        if kv_caches is not None:
            fits = [
                cache.shape == shape and cache.dtype == storage and cache.device.type == device.type
                for cache in kv_caches
            ]
            if len(fits) != config.num_layers or not all(fits):
                raise ValueError(
                    f"the shared KV caches are not {config.num_layers} caches of shape {shape} "
                    f"and dtype {storage} on {device}"
                )
            self.kv_caches = list(kv_caches)
        else:
            self.kv_caches = [zeroed_cache(shape, storage, device, buffer) for buffer in buffers]
        self._keys_from_cache = not self.kv_format.is_exact_for(dtype)
        bf16_prefill = bf16_matmul and cpu_has_fast_bf16()
        self.attention_backend: AttentionBackend = select_attention_backend(
            attention_backend, device, dtype, bf16_prefill
        )
        backend = self.attention_backend
        self.kernels = backend.kernels if isinstance(backend, CPUNativeBackend) else None
        self.uses_cpu_fast_paths = model.use_cpu_fast_paths(self.kernels, bf16_matmul)
        self.argmax: Argmax = self.kernels.elementwise.argmax if self.kernels is not None else torch_argmax

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
    ) -> torch.Tensor:
        """The final hidden states of a step's tokens (sequences with a single query token first), whose keys and
        values it writes into the cache."""
        meta = self.metadata(block_tables, context_lens, query_lens)
        ids = torch.tensor(input_ids, device=self.device)
        return self.model(ids, torch.tensor(positions, device=self.device), self.kv_caches, meta)

    def metadata(
        self, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int]
    ) -> AttentionMetadata:
        """The attention layout of a step (see `run`), for a caller that runs the layers itself."""
        return build_attention_metadata(
            self.attention_backend,
            block_tables,
            context_lens,
            query_lens,
            self.block_size,
            self.dtype,
            self.device,
            self._keys_from_cache,
        )


class ModelRunner(PagedModel):
    """The engine's PagedModel: samples a token for every request a step completes."""

    @property
    def blends(self) -> bool:
        """Whether it runs a blended prompt (a ScheduledRequest with segments: kvyard.engine.blend): blending moves
        keys and values; latent attention's rows are not written for it yet."""
        return self.model.config.latent is None

    @cached_property
    def _generators(self) -> dict[str, torch.Generator]:
        """Per-request seeded generators, by request id."""
        return {}

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        """One forward pass, then a sampled token for every request whose sequence it completes."""
        batch = self.forward(scheduled)
        if not batch.sampling:
            return batch.pooled
        rows = [
            self._sampling_row(item, ahead) for item in batch.sampling for ahead in range(1 + len(item.spec_token_ids))
        ]
        _constrain(rows, batch.sampling)
        token_ids, logprobs = sample(batch.logits, rows, self.argmax)
        sampled: list[SampledToken] = []
        row = 0
        for item in batch.sampling:
            spec = item.spec_token_ids
            if spec:  # the i-th emitted token was sampled from row + i, after the i kept guesses before it
                emitted = accept_greedy(spec, token_ids[row : row + 1 + len(spec)])
                sampled += [
                    SampledToken(item.request, token_id, logprobs[row + i]) for i, token_id in enumerate(emitted)
                ]
            else:
                sampled.append(SampledToken(item.request, token_ids[row], logprobs[row]))
            row += 1 + len(item.spec_token_ids)
        return sampled + batch.pooled

    def _blend(self, item: ScheduledRequest) -> torch.Tensor:
        """The last prompt token's final hidden state of a request whose prompt blends moved text's KV."""
        request = item.request
        settings = request.blend or BlendSettings()
        table, start = request.block_table, request.num_computed_tokens
        return blend_prefill(self, request.all_token_ids, table, start, item.segments, settings).hidden

    def _score_prompt(self, request: Request, hidden: torch.Tensor, first_position: int) -> None:
        """Logprobs of the prompt tokens that follow positions first_position.. (the rows of `hidden`), kept on
        the request in prompt order; positions scored before a preemption are not scored again."""
        num_top = request.sampling_params.prompt_logprobs or 0
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # nothing predicts the first token
        for block_start in range(0, hidden.shape[0], PROMPT_SCORING_ROWS):
            block = hidden[block_start : block_start + PROMPT_SCORING_ROWS]
            log_probs = self.model.compute_logits(block).float().log_softmax(dim=-1)
            for row in range(block.shape[0]):
                target = first_position + block_start + row + 1
                if target != len(request.prompt_logprobs):
                    continue
                request.prompt_logprobs.append(_scored_token(log_probs[row], request.prompt_token_ids[target], num_top))

    @cached_property
    def _pooler(self) -> PromptPooler:
        return PromptPooler()

    def _pool(
        self, request: Request, hidden: torch.Tensor, first_position: int, completes: bool
    ) -> SampledToken | None:
        """Feed a pooling request's chunk (the rows of `hidden`) to its pooling; its result once the prompt is done."""
        params = request.pooling
        assert params is not None
        if params.reads_every_position:
            self._pooler.add_chunk(request.request_id, hidden, first_position)
        if not completes:
            return None
        last = hidden[-1]
        if params.choice_token_ids is not None:
            score = choice_score(self.model.compute_logits(last[None])[0], params.choice_token_ids)
            return SampledToken(request, -1, pooled=[score])
        return SampledToken(
            request, -1, pooled=self._pooler.embedding(request.request_id, params, last, request.num_prompt_tokens)
        )

    def release(self, request: Request) -> None:
        self._generators.pop(request.request_id, None)
        self._pooler.release(request.request_id)

    def _sampling_row(self, item: ScheduledRequest, ahead: int = 0) -> SamplingRow:
        """How to sample the request's output position `num_output_tokens + ahead` (ahead > 0: after `ahead` of
        this step's proposals, which count as output for penalties: a row after a rejected one is discarded)."""
        request = item.request
        history = None
        if request.sampling_params.has_penalties:
            output = [*request.output_token_ids, *item.spec_token_ids[:ahead]] if ahead else request.output_token_ids
            history = TokenHistory(request.prompt_token_ids, output)
        banned = tuple(request.banned_token_ids(item.spec_token_ids[:ahead]))
        return SamplingRow(request.sampling_params, self._generator(request, ahead), banned, history)

    def _generator(self, request: Request, ahead: int) -> torch.Generator | None:
        """A generator seeded for output position `num_output_tokens + ahead` (None: no seed); positions after the
        next one get their own, as their draws happen in the same step."""
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id) if ahead == 0 else None
        if generator is None:
            generator = torch.Generator(device=self.device)
            if ahead == 0:
                self._generators[request.request_id] = generator
        # Seeded by position, not by history: the same seed draws the same token at the same output
        # position on any replica, so a stream resumed elsewhere continues exactly.
        generator.manual_seed((seed + (request.num_output_tokens + ahead) * _SEED_STRIDE) % 2**64)
        return generator

    def forward(self, scheduled: Sequence[ScheduledRequest]) -> BatchLogits:
        """Run one forward pass; `scheduled` lists decodes (with or without proposed tokens) first.

        A decode with proposed tokens (a verification) runs as one single-token query per position, each attending
        to the context up to it: exactly what plain decoding computes at that position, down to the bits, so the
        model's choice at every position is the one it makes without speculation (a chunk of those tokens goes
        through the prefill attention kernel, whose sums run in another order).

        The caller holds torch.inference_mode (the sampler then edits logits in place)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        scoring: list[tuple[Request, int, int, int]] = []  # prompt scoring: request, first row and position, rows
        pooling: list[tuple[ScheduledRequest, int, int]] = []  # pooling requests: item, first row and position
        block_tables: list[list[int]] = []
        context_lens: list[int] = []
        query_lens: list[int] = []
        blended = [item for item in scheduled if item.segments]
        for item in scheduled:
            if item.segments:
                continue
            request = item.request
            start = request.num_computed_tokens
            num_known = item.num_new_tokens - len(item.spec_token_ids)
            if request.needs_prompt_logprobs:
                scoring.append((request, len(input_ids), start, min(num_known, request.num_prompt_tokens - 1 - start)))
            if request.pooling is not None:
                pooling.append((item, len(input_ids), start))
            input_ids.extend(request.all_token_ids[start : start + num_known])
            input_ids.extend(item.spec_token_ids)
            positions.extend(range(start, start + item.num_new_tokens))
            if item.completes_sequence and request.pooling is None:
                sample_rows.extend(range(len(input_ids) - 1 - len(item.spec_token_ids), len(input_ids)))
                sampling.append(item)
            queries = range(1, item.num_new_tokens + 1) if item.spec_token_ids else [item.num_new_tokens]
            for end in queries:
                block_tables.append(request.block_table)
                context_lens.append(start + end)
                query_lens.append(end if not item.spec_token_ids else 1)
        empty = torch.empty(0, self.model.config.hidden_size, device=self.device, dtype=self.dtype)
        hidden = self.run(input_ids, positions, block_tables, context_lens, query_lens) if input_ids else empty
        for request, first_row, first_position, num_rows in scoring:
            self._score_prompt(request, hidden[first_row : first_row + max(0, num_rows)], first_position)
        pooled = [
            self._pool(
                item.request,
                hidden[first_row : first_row + item.num_new_tokens],
                first_position,
                item.completes_sequence,
            )
            for item, first_row, first_position in pooling
        ]
        done = [result for result in pooled if result is not None]
        last = [hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]]
        last += [self._blend(item) for item in blended]
        sampling += blended
        if not sampling:
            return BatchLogits(torch.empty(0, device=self.device), [], done)
        return BatchLogits(self.model.compute_logits(torch.cat(last)), sampling, done)


def _scored_token(log_probs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    """A prompt token's logprob, its rank as vLLM counts it (the tokens at least as likely) and the `num_top` most
    likely tokens, from one position's `log_probs`."""
    logprob = log_probs[token_id]
    top = log_probs.topk(num_top) if num_top else None
    return TokenLogprobs(
        token_id,
        float(logprob),
        dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {},
        int((log_probs >= logprob).sum()),
    )


def _constrain(rows: list[SamplingRow], sampling: list[ScheduledRequest]) -> None:
    """Give the row of each request with a grammar the tokens it allows next (such requests do not speculate,
    so they have one row)."""
    constrained: list[tuple[int, GrammarMatcher]] = []
    row = 0
    for item in sampling:
        if item.request.grammar is not None:
            constrained.append((row, item.request.grammar))
        row += 1 + len(item.spec_token_ids)
    if constrained:
        masks = allowed_tokens([grammar for _, grammar in constrained])
        for (index, _), mask in zip(constrained, masks):
            rows[index].allowed_tokens = mask


def accept_greedy(proposed: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits: `targets[i]` is the model's token after the query's i-th position
    (its last known token, then each proposal); proposals are kept while they equal the model's choice, and the
    model's own token follows the last kept one."""
    accepted = 0
    while accepted < len(proposed) and proposed[accepted] == targets[accepted]:
        accepted += 1
    return [*proposed[:accepted], targets[accepted]]

"""The engine loop: admit requests, schedule a step, run the model, sample, detect stops."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvyard.engine.block_pool import BlockPool
from kvyard.engine.detokenizer import IncrementalDetokenizer
from kvyard.engine.kv_cache_manager import KVCacheManager
from kvyard.engine.kv_tier_link import KVTierLink
from kvyard.engine.model_runner import ModelRunner, kv_block_bytes
from kvyard.engine.request import Request, RequestStatus, TokenLogprobs
from kvyard.engine.sampler import SamplingRow, sample
from kvyard.engine.sampling_params import SamplingParams
from kvyard.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.config import KVTierConfig
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.stats import StoreSnapshot
from kvyard.models.config import ModelConfig, load_model_config
from kvyard.models.loader import load_model, model_digest, resolve_dtype


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    served_model_name: str | None = None
    record_kv_events: bool = False
    kv_tier: KVTierConfig | None = None  # persistent KV tier below the device cache; None: off


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """time.monotonic() stamps of a request's life, for latency metrics (TTFT = first_token - arrival)."""

    arrival: float
    first_token: float | None
    finished: float | None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None
    times: RequestTimes | None = None


@dataclass(slots=True)
class _Tracked:
    request: Request
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    stop_token_ids: frozenset[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config: ModelConfig = load_model_config(config.model)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.tokenizer = _load_tokenizer(config.model)
        model = load_model(config.model, self.dtype, self.device, self.max_model_len, self.model_config)
        self.num_kv_blocks = self._choose_num_blocks()
        self.kv_events = KVEventLog() if config.record_kv_events else None
        self.block_pool = BlockPool(self.num_kv_blocks, config.enable_prefix_caching, self.kv_events)
        self.kv_manager = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs), self.kv_manager)
        self.runner = ModelRunner(model, self.num_kv_blocks, config.block_size, self.dtype, self.device)
        self.model_name = config.served_model_name or Path(config.model).name
        self.namespace = KeyNamespace(
            model_name=self.model_name,
            model_digest=model_digest(config.model),
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=config.block_size,
        )
        self._requests: dict[str, _Tracked] = {}
        self.kv_tier = self._attach_kv_tier()

    def _attach_kv_tier(self) -> KVTierLink | None:
        tier = self.config.kv_tier
        if tier is None or not self.config.enable_prefix_caching:
            return None
        link = KVTierLink(tier.build(), self.runner.kv_caches, self.config.block_size, tier.load_deadline_s)
        self.kv_manager.tier = link
        return link

    def kv_tier_snapshot(self) -> StoreSnapshot | None:
        """The KV tier's counters (thread-safe); None when the tier is off."""
        tier = self.kv_tier
        return tier.store.snapshot() if tier is not None else None

    def close(self) -> None:
        """Finish queued KV-tier writes and release the tier; the engine must not step afterwards."""
        if self.kv_tier is not None:
            self.kv_manager.tier = None
            self.kv_tier.close()
            self.kv_tier = None

    def _choose_num_blocks(self) -> int:
        blocks_per_seq = -(-self.max_model_len // self.config.block_size)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_block_bytes(self.model_config, self.config.block_size, self.dtype)
        by_memory = int(self.config.kv_cache_memory_gb * (1 << 30)) // per_block
        return max(1, min(by_memory, blocks_per_seq * self.config.max_num_seqs))

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> Request:
        self._validate(request_id, prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            cache_root_key=self.namespace.with_salt(cache_salt).root_key(),
            block_size=self.config.block_size,
        )
        self._requests[request_id] = _Tracked(
            request=request,
            generator=_seeded_generator(params.seed, self.device),
            detokenizer=self._make_detokenizer(params),
            stop_token_ids=frozenset(self._stop_token_ids(params)),
        )
        self.scheduler.add(request)
        return request

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the model's context is {self.max_model_len} "
                "tokens and at least one must be left to generate"
            )
        needed = -(-min(len(prompt_token_ids) + params.max_tokens, self.max_model_len) // self.config.block_size)
        if needed > self.num_kv_blocks:
            raise ValueError(f"prompt plus max_tokens needs {needed} KV blocks but the pool has {self.num_kv_blocks}")

    def _make_detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            if params.stop:
                raise ValueError("stop strings need a tokenizer, and this model directory has none")
            return None
        return IncrementalDetokenizer(self.tokenizer, list(params.stop), params.include_stop_str_in_output)

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        return stop

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def abort_request(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None and not tracked.request.is_finished:
            self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that produced a token."""
        schedule = self.scheduler.schedule()
        if not schedule.scheduled:
            return []
        scheduled = sorted(schedule.scheduled, key=lambda s: s.num_new_tokens != 1)
        batch = self.runner.execute(scheduled)
        for item in scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            self.kv_manager.register_computed_blocks(item.request)
        if not batch.sampling:
            return []
        rows = [self._sampling_row(item) for item in batch.sampling]
        token_ids, logprobs = sample(batch.logits, rows, self.runner.argmax)
        now = time.monotonic()
        return [
            self._accept_token(item.request, token_id, token_logprobs, now)
            for item, token_id, token_logprobs in zip(batch.sampling, token_ids, logprobs)
        ]

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        tracked = self._requests[item.request.request_id]
        params = item.request.sampling_params
        banned: tuple[int, ...] = ()
        if item.request.num_output_tokens < params.min_tokens:
            banned = tuple(tracked.stop_token_ids)
        return SamplingRow(params, tracked.generator, banned)

    def _accept_token(
        self, request: Request, token_id: int, token_logprobs: TokenLogprobs | None, now: float
    ) -> RequestOutput:
        tracked = self._requests[request.request_id]
        request.append_token(token_id)
        if token_logprobs is not None:
            request.output_logprobs.append(token_logprobs)
        if request.first_token_time is None:
            request.first_token_time = now
        new_text, stop_string = "", None
        if tracked.detokenizer is not None:
            new_text, stop_string = tracked.detokenizer.push(token_id)
        status = self._finish_status(request, tracked, token_id, stop_string)
        if status is not None:
            if tracked.detokenizer is not None and stop_string is None:
                new_text += tracked.detokenizer.finish()
            self.scheduler.finish(request, status)
            del self._requests[request.request_id]
        return self._output(request, tracked, [token_id], new_text)

    def _finish_status(
        self, request: Request, tracked: _Tracked, token_id: int, stop_string: str | None
    ) -> RequestStatus | None:
        params = request.sampling_params
        if stop_string is not None:
            request.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if token_id in tracked.stop_token_ids and request.num_output_tokens >= params.min_tokens:
            request.stop_reason = token_id if token_id not in self.eos_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, tracked: _Tracked, new_token_ids: list[int], new_text: str) -> RequestOutput:
        finished = request.is_finished
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=tracked.detokenizer.text if tracked.detokenizer is not None else "",
            finished=finished,
            finish_reason=request.status.value if finished else None,
            num_cached_tokens=max(0, request.num_cached_tokens),
            new_token_ids=new_token_ids,
            new_text=new_text,
            logprobs=request.output_logprobs if request.sampling_params.logprobs is not None else None,
            stop_reason=request.stop_reason,
            times=RequestTimes(request.arrival_time, request.first_token_time, time.monotonic() if finished else None),
        )

    # ----------------------------------------------------------------- stats

    def stats(self) -> dict[str, Any]:
        return {
            "num_waiting": self.scheduler.num_waiting,
            "num_running": self.scheduler.num_running,
            "kv_blocks_total": self.num_kv_blocks,
            "kv_blocks_used": self.block_pool.num_used_blocks,
            "prefix_cache_queried_tokens": self.kv_manager.num_queried_tokens,
            "prefix_cache_hit_tokens": self.kv_manager.num_hit_tokens,
            "kv_tier_hit_tokens": self.kv_manager.num_tier_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
        }


def _seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _load_tokenizer(model_dir: str) -> Any:
    if not any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)

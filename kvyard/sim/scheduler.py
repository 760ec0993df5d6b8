"""Continuous batching of simulated requests on a virtual clock: the engine's scheduler, minus the model.

Each step has a budget of `max_num_batched_tokens`: running requests first, oldest first (one token
for a decode, the rest of or a chunk of the prompt for a prefill), then waiting requests while the
budget, `max_num_seqs` and the cache capacity allow. A running request that cannot get a block
preempts the newest running request, which is recomputed later (much of it from the prefix cache).

`schedule()` picks a step and its `StepShape` (the cost model turns it into seconds); `complete()`
applies the step: computed tokens, newly cached blocks, and one deterministic output token for
every request whose known tokens are all computed. Neither reads a clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvyard.kvcache.block_key import chain_block_keys
from kvyard.sim.cost_model import StepShape, prefill_pairs
from kvyard.sim.prefix_cache import BlockTable, PrefixCache
from kvyard.sim.tokens import output_token


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    root_key: bytes  # the namespace root (with the tenant's cache salt) the block keys chain from
    output_seed: int
    block_size: int
    token_ids: list[int] = field(init=False)
    block_keys: list[bytes] = field(init=False, default_factory=list)
    table: BlockTable = field(init=False, default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    finish_reason: str | None = None
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._extend_block_keys()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self._extend_block_keys()

    def _extend_block_keys(self) -> None:
        start = len(self.block_keys) * self.block_size
        parent = self.block_keys[-1] if self.block_keys else self.root_key
        self.block_keys.extend(chain_block_keys(parent, self.token_ids[start:], self.block_size))


@dataclass(slots=True)
class ScheduledChunk:
    request: SimRequest
    num_new_tokens: int


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)


@dataclass(slots=True)
class TokenOutput:
    request: SimRequest
    token_id: int
    first: bool
    finished: bool


@dataclass(slots=True)
class SimScheduler:
    limits: SchedulerLimits
    cache: PrefixCache
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    num_preemptions: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.limits.block_size)

    def add(self, request: SimRequest) -> None:
        if request.block_size != self.limits.block_size:
            raise ValueError(f"request block size {request.block_size} != scheduler's {self.limits.block_size}")
        self.waiting.append(request)

    def abort(self, request: SimRequest) -> None:
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "abort")

    @property
    def tokens_in_flight(self) -> int:
        return sum(r.num_tokens for r in self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.limits.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        plan.shape = _shape_of(plan.chunks)
        return plan

    def complete(self, plan: StepPlan) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        stored: list[bytes] = []
        block_size = self.limits.block_size
        for chunk in plan.chunks:
            request = chunk.request
            if request.finish_reason is not None:  # aborted while the step ran
                continue
            request.num_computed += chunk.num_new_tokens
            if request.num_computed >= (request.num_registered + 1) * block_size:
                self._register_computed(request, stored)
            if request.num_computed == len(request.token_ids):
                outputs.append(self._sample(request))
        self.cache.record_stored(stored)
        return outputs

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        index = 0
        block_size = self.limits.block_size
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(len(request.token_ids) - request.num_computed, budget)
            num_blocks = -(-(request.num_computed + num_new) // block_size) - len(request.table)
            if num_blocks > 0 and not self._allocate_or_preempt(request, num_blocks, plan):
                break
            plan.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: SimRequest, num_blocks: int, plan: StepPlan) -> bool:
        while not self.cache.acquire(request.table, (), num_blocks):
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: SimRequest) -> None:
        self.cache.release(request.table)
        request.num_computed = 0
        request.num_registered = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        block_size = self.limits.block_size
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            max_cached_blocks = (request.num_tokens - 1) // block_size  # the last token is always computed
            cached = request.block_keys[: self.cache.match(request.block_keys[:max_cached_blocks])]
            num_cached = len(cached) * block_size
            num_new = min(request.num_tokens - num_cached, budget)
            num_blocks = self.blocks_needed(num_cached + num_new) - len(cached)
            if not self.cache.acquire(request.table, cached, num_blocks):
                break
            self.waiting.popleft()
            request.num_computed = num_cached
            request.num_registered = len(cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += num_cached
            self.running.append(request)
            plan.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new

    def _register_computed(self, request: SimRequest, stored: list[bytes]) -> None:
        num_full = min(request.num_computed // self.limits.block_size, len(request.block_keys))
        for index in range(request.num_registered, num_full):
            if self.cache.register(request.table, index, request.block_keys[index]):
                stored.append(request.block_keys[index])
        request.num_registered = max(request.num_registered, num_full)

    def _sample(self, request: SimRequest) -> TokenOutput:
        token_id = output_token(request.output_seed, request.num_output_tokens)
        request.append_token(token_id)
        finished = request.num_output_tokens >= request.max_tokens
        if finished:
            self.running.remove(request)
            self._finish(request, "length")
        return TokenOutput(request, token_id, request.num_output_tokens == 1, finished)

    def _finish(self, request: SimRequest, reason: str) -> None:
        request.finish_reason = reason
        self.cache.release(request.table)


def _shape_of(chunks: list[ScheduledChunk]) -> StepShape:
    prefill_tokens = pairs = decode_seqs = decode_context = 0
    for chunk in chunks:
        request = chunk.request
        num_tokens = len(request.token_ids)
        if request.num_computed == num_tokens - 1 and num_tokens > request.num_prompt_tokens:  # decoding
            decode_seqs += 1
            decode_context += num_tokens
        else:
            prefill_tokens += chunk.num_new_tokens
            pairs += prefill_pairs(chunk.num_new_tokens, request.num_computed)
    return StepShape(prefill_tokens, pairs, decode_seqs, decode_context)

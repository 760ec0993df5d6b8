"""Token-budget scheduler: continuous batching with chunked prefill and recompute preemption.

Every step has a budget of `max_num_batched_tokens` (or `prefill_only_step_tokens`, when set, while no running
request streams: a long step then holds up no stream, and fewer steps read the weights fewer times). Running
requests are served first, oldest first: one token for a decode, the rest of (or a chunk of) the prompt for a
prefill. Then waiting requests are admitted, oldest first, while the budget, `max_num_seqs` and free blocks allow.
When a running request cannot get a block, the newest running request is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed (much of it usually from the prefix cache). Serving and
admitting strictly by age means no request starves.

With `prefill_order="shortest"` the decodes are served first, oldest first, and then the prompts, running or waiting
alike, those with the fewest tokens left to compute first: a prompt that arrives while a long one is being computed
starts at the next step instead of after it. Where a time-to-first-token bound grows with the prompt's length, as
it does in an SLO, that lets the short prompts meet it at little cost to the long ones. A prompt passed over
`MAX_STEPS_PASSED_OVER` times is served before the shorter ones, so none starves; and a prompt chunk never preempts
a request already served in the step (it waits instead).

With `scheduling_policy="priority"` each request's `priority` (lower first, then arrival) orders the queue and the
running requests in place of age: the most urgent are admitted and served first, and the least urgent running
request is the one preempted (vLLM's priority policy). Under the default "fcfs" every request has priority 0.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from kvyard.engine.blend.segments import SegmentMatch
from kvyard.engine.scheduling.kv_cache_manager import KVCacheManager
from kvyard.engine.scheduling.request import Request, RequestStatus
from kvyard.settings import setting

PREFILL_ORDERS = ("fcfs", "shortest")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Shortest-first starves nothing: a prompt passed over this many steps is served before the shorter ones.
MAX_STEPS_PASSED_OVER = 64
# A blend runs whole in one step: at most this many steps' token budget of work, so it holds running streams up
# about as long; a longer one is computed exactly, in chunks.
BLEND_STEP_BUDGETS = 4


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling: how much work one step may take."""

    max_num_batched_tokens: int = setting(2048, help="token budget of one step: decode tokens plus prefill chunks")
    max_num_seqs: int = setting(256, help="requests computed at once; more wait in the queue")
    prefill_only_step_tokens: int = setting(
        0,
        help="token budget of a step while no running request streams "
        "(has output or its whole prompt computed), so that no client waits on "
        "it, as on a prefill replica; 0: max_num_batched_tokens",
    )
    prefill_order: str = setting(
        "fcfs",
        choices=PREFILL_ORDERS,
        help="which prompts a step computes first, once "
        "the decodes are served: fcfs, oldest first; shortest, the fewest tokens left to "
        "compute first (prefix-cache hits and pulled blocks not counted), so a long prompt "
        "being computed yields to shorter ones that arrive meanwhile; a prompt passed over "
        f"{MAX_STEPS_PASSED_OVER} steps goes first",
    )
    scheduling_policy: str = setting(
        "fcfs",
        choices=SCHEDULING_POLICIES,
        help="which requests go first: fcfs, "
        "by age (the newest running request is preempted when blocks run out); "
        "priority, by each request's priority, lower first, then by age (the "
        "lowest-priority running request is preempted); under fcfs a request with a "
        "priority other than 0 is refused",
    )

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.prefill_only_step_tokens < 0:
            raise ValueError(f"prefill_only_step_tokens must be >= 0, got {self.prefill_only_step_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens to compute, then the proposed ones
    spec_token_ids: list[int] = field(default_factory=list)  # proposed tokens after the known ones (speculation)
    segments: list[SegmentMatch] = field(default_factory=list)  # blended: the rest of the prompt reuses these

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token is computed, so the next token can be sampled."""
        num_known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + num_known == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._by_priority = config.scheduling_policy == "priority"
        self._pinned_segments: list[int] = []  # blocks a blend of the last step read: kept until it ran

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if self._by_priority:
            _insert_by_priority(self.waiting, request)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self.kv.pool.free(self._pinned_segments)
        self._pinned_segments = []
        output = SchedulerOutput()
        if self.config.prefill_order == "shortest":
            self._schedule_shortest_first(output, self._step_budget())
            return output
        budget = self._schedule_running(output, self._step_budget())
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def _step_budget(self) -> int:
        """`max_num_batched_tokens`, or the prefill-only budget while no running request streams."""
        larger = self.config.prefill_only_step_tokens
        if larger and not any(request.streams for request in self.running):
            return larger
        return self.config.max_num_batched_tokens

    def _schedule_running(self, output: SchedulerOutput, budget: int, decodes_only: bool = False) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if decodes_only and _tokens_left(request) > 1:
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            spec = self._speculation(request, budget - num_new)
            # Proposed tokens get slots only when they are free: speculation never preempts anyone.
            if spec and self.kv.allocate_slots(request, num_new + len(spec)):
                output.scheduled.append(ScheduledRequest(request, num_new + len(spec), spec))
                budget -= num_new + len(spec)
                index += 1
                continue
            if not self._allocate_or_preempt(request, num_new, output):
                break
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        return budget

    @staticmethod
    def _speculation(request: Request, budget: int) -> list[int]:
        """The request's proposed tokens that fit the step's budget and its max_tokens (the last token it may
        emit is always the model's own)."""
        room = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return request.spec_token_ids[: max(0, min(budget, room))]

    def _allocate_or_preempt(self, request: Request, num_new: int, output: SchedulerOutput) -> bool:
        """Blocks for `num_new` more tokens of `request`, preempting the newest running requests for them. False
        when `request` itself was preempted, or when the newest already runs in this step (shortest-first serves
        requests out of age order): then `request` waits."""
        while not self.kv.allocate_slots(request, num_new):
            if any(item.request is self.running[-1] for item in output.scheduled):
                return False
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.reset_for_recompute()
        if self._by_priority:
            _insert_by_priority(self.waiting, request)
        else:
            self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _schedule_shortest_first(self, output: SchedulerOutput, budget: int) -> None:
        """Decodes first, oldest first; then the prompts, running or waiting, fewest tokens left first."""
        budget = self._schedule_running(output, budget, decodes_only=True)
        prompts = [request for request in self.running if _tokens_left(request) > 1]
        prompts += [request for request in self._oldest_waiting() if self.kv.ready_to_admit(request)]
        prompts.sort(key=self._prefill_priority)
        admitting = not output.preempted
        for request in prompts:
            if budget <= 0:
                request.num_steps_passed_over += 1
            elif request.status is RequestStatus.RUNNING:
                if request in self.running:  # not preempted for an earlier one this step
                    budget = self._schedule_prompt_chunk(output, request, budget)
                else:
                    request.num_steps_passed_over += 1
            elif admitting and len(self.running) < self.config.max_num_seqs and not output.preempted:
                admitted = self._admit(output, request, budget)
                budget -= admitted
                admitting = admitted > 0

    def _oldest_waiting(self) -> list[Request]:
        """The waiting requests shortest-first chooses among: the oldest `max_num_seqs`, whose tier loads and pulls
        (started by `ready_to_admit`) then run while other prompts are computed; a longer queue waits its turn."""
        return list(itertools.islice(self.waiting, self.config.max_num_seqs))

    def _prefill_priority(self, request: Request) -> tuple[int, bool, int, float]:
        priority = request.priority if self._by_priority else 0
        if request.num_steps_passed_over >= MAX_STEPS_PASSED_OVER:
            return priority, False, 0, request.arrival_time
        if request.status is RequestStatus.RUNNING:
            return priority, True, _tokens_left(request), request.arrival_time
        num_left = request.num_tokens - self.kv.num_cached_tokens_estimate(request)
        return priority, True, num_left, request.arrival_time

    def _schedule_prompt_chunk(self, output: SchedulerOutput, request: Request, budget: int) -> int:
        num_new = min(_tokens_left(request), budget)
        if not self._allocate_or_preempt(request, num_new, output):
            request.num_steps_passed_over += 1
            return budget
        output.scheduled.append(ScheduledRequest(request, num_new))
        return budget - num_new

    def _admit(self, output: SchedulerOutput, request: Request, budget: int) -> int:
        """Admit a waiting request with up to `budget` tokens of it: the tokens scheduled (0: no room)."""
        cached_blocks = self.kv.find_cached_prefix(request)
        num_cached = len(cached_blocks) * self.kv.block_size
        segments = self._segments_to_blend(request, num_cached)
        num_new = request.num_tokens - num_cached if segments else min(request.num_tokens - num_cached, budget)
        if segments and not self._pin_and_allocate(request, num_new, cached_blocks, segments):
            segments, num_new = [], min(request.num_tokens - num_cached, budget)
        if not segments and not self.kv.allocate_slots(request, num_new, cached_blocks):
            return 0
        self.waiting.remove(request)
        self.kv.record_lookup(request.num_tokens, num_cached)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        if self._by_priority:
            _insert_by_priority(self.running, request)
        else:
            self.running.append(request)
        if segments:
            request.exact_until = num_cached
            request.num_blended_tokens = len(segments) * self.kv.block_size
            output.scheduled.append(ScheduledRequest(request, num_new, segments=segments))
            return min(budget, max(1, _blend_cost(request, num_new)))
        output.scheduled.append(ScheduledRequest(request, num_new))
        return num_new

    def _segments_to_blend(self, request: Request, num_cached: int) -> list[SegmentMatch]:
        """Moved text `request` may reuse after its cached prefix: for a request that asked to blend, whose prompt's
        outputs are not wanted position by position, whose prefix ended at a miss (not at the last block, which
        is always computed), when moved text is at least `min_reused_fraction` of what is left and the blend's
        work fits in BLEND_STEP_BUDGETS steps' budget (it runs in one step)."""
        settings = request.blend
        if settings is None or request.computes_whole_prompt or request.pooling is not None:
            return []
        size, num_left = self.kv.block_size, request.num_tokens - num_cached
        if request.kv_transfer is not None or num_cached // size >= (request.num_tokens - 1) // size:
            return []
        segments = self.kv.find_segments(request, num_cached)
        num_reused = len(segments) * size
        if num_reused < settings.min_reused_fraction * num_left:
            return []
        if settings.tokens_computed(num_left, num_reused) > BLEND_STEP_BUDGETS * self.config.max_num_batched_tokens:
            return []
        return segments

    def _pin_and_allocate(
        self, request: Request, num_new: int, cached_blocks: list[int], segments: list[SegmentMatch]
    ) -> bool:
        """Blocks for the whole rest of the prompt, with the segments' blocks held until the blend has read them;
        False, holding nothing, when the pool has no room for both."""
        sources = [match.block_id for match in segments]
        if len(sources) > self.kv.pool.num_free_blocks:
            return False
        self.kv.pool.touch(sources)
        if not self.kv.allocate_slots(request, num_new, cached_blocks):
            self.kv.pool.free(sources)
            return False
        self._pinned_segments.extend(sources)
        return True

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        index = 0  # requests whose blocks are still loading from the KV tier wait; those behind them go on
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[index]
            if not self.kv.ready_to_admit(request):
                index += 1
                continue
            admitted = self._admit(output, request, budget)
            if not admitted:
                break
            budget -= admitted

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of scheduling and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)


def _blend_cost(request: Request, num_new: int) -> int:
    """The step budget a blend takes: the tokens it recomputes. It runs whole, so it may take more than is left."""
    settings = request.blend
    return settings.tokens_computed(num_new, request.num_blended_tokens) if settings is not None else num_new


def _tokens_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


def _insert_by_priority(requests: deque[Request] | list[Request], request: Request) -> None:
    """Insert `request` into `requests`, kept in (priority, arrival) order, after those with its own key."""
    requests.insert(bisect.bisect_right(requests, _priority_key(request), key=_priority_key), request)

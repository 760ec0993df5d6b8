"""Scheduler with a real BlockPool/KVCacheManager, driven by a model-free engine loop."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.block_pool import BlockPool
from kvyard.engine.scheduling.kv_cache_manager import KVCacheManager
from kvyard.engine.scheduling.request import Request, RequestStatus
from kvyard.engine.scheduling.scheduler import MAX_STEPS_PASSED_OVER, Scheduler, SchedulerConfig, SchedulerOutput

ROOT = b"r" * 16


@dataclass
class Sim:
    """An engine loop without a model: scheduled tokens are 'computed', then a token is 'sampled'."""

    num_blocks: int
    block_size: int = 4
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    enable_caching: bool = True
    prefill_only_step_tokens: int = 0
    prefill_order: str = "fcfs"
    scheduling_policy: str = "fcfs"
    pool: BlockPool = field(init=False)
    kv: KVCacheManager = field(init=False)
    scheduler: Scheduler = field(init=False)
    requests: list[Request] = field(default_factory=list)
    outputs_wanted: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    finish_step: dict[str, int] = field(default_factory=dict)
    history: list[SchedulerOutput] = field(default_factory=list)
    num_steps: int = 0

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.enable_caching)
        self.kv = KVCacheManager(self.pool, self.block_size)
        config = SchedulerConfig(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.prefill_only_step_tokens,
            self.prefill_order,
            self.scheduling_policy,
        )
        self.scheduler = Scheduler(config, self.kv)

    def add(self, prompt: list[int], num_outputs: int, priority: int = 0) -> Request:
        request = Request(
            request_id=f"req{len(self.requests)}",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=num_outputs, priority=priority),
            cache_root_key=ROOT,
            block_size=self.block_size,
        )
        self.requests.append(request)
        self.outputs_wanted[request.request_id] = num_outputs
        self.scheduler.add(request)
        return request

    def step(self) -> SchedulerOutput:
        running_before = list(self.scheduler.running)
        out = self.scheduler.schedule()
        self.num_steps += 1
        self.history.append(out)
        self._check_output(out, running_before)
        for item in out.scheduled:
            request = item.request
            completes = item.completes_sequence
            request.num_computed_tokens += item.num_new_tokens
            assert request.num_computed_tokens <= request.num_tokens
            self.kv.register_computed_blocks(request)
            if completes:
                # A deterministic "sampled" token that differs between requests.
                request.append_token((7 * request.num_tokens + int(request.request_id[3:])) % 50)
                if request.num_output_tokens >= self.outputs_wanted[request.request_id]:
                    self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                    self.finished.append(request.request_id)
                    self.finish_step[request.request_id] = self.num_steps
        self._check_accounting()
        return out

    def run(self, max_steps: int) -> None:
        while self.scheduler.has_unfinished():
            assert self.num_steps < max_steps, f"not finished after {max_steps} steps: starvation or livelock"
            self.step()

    def _check_output(self, out: SchedulerOutput, running_before: list[Request]) -> None:
        config = self.scheduler.config
        streams = any(r.streams for r in running_before)
        budget = (
            config.prefill_only_step_tokens
            if config.prefill_only_step_tokens and not streams
            else (config.max_num_batched_tokens)
        )
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= config.max_num_seqs
        assert self.scheduler.num_running <= config.max_num_seqs
        ids = [id(s.request) for s in out.scheduled]
        assert len(set(ids)) == len(ids), "a request scheduled twice in one step"
        for item in out.scheduled:
            assert item.num_new_tokens >= 1
            assert item.request.num_computed_tokens + item.num_new_tokens <= item.request.num_tokens
            assert item.request in self.scheduler.running
            # The blocks cover every token computed after this step.
            needed = -(-(item.request.num_computed_tokens + item.num_new_tokens) // self.block_size)
            assert len(item.request.block_table) == needed
        # Victims are the last running requests (the newest; under priority the least urgent), last first, and none
        # of them runs this step.
        assert out.preempted == list(reversed(running_before))[: len(out.preempted)]
        for victim in out.preempted:
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.block_table == [] and victim.num_computed_tokens == 0
            assert victim not in self.scheduler.running and victim in self.scheduler.waiting
            assert all(s.request is not victim for s in out.scheduled)
        if self.scheduling_policy == "priority":
            keys = [(r.priority, r.arrival_time) for r in self.scheduler.running]
            assert keys == sorted(keys)
            keys = [(r.priority, r.arrival_time) for r in self.scheduler.waiting]
            assert keys == sorted(keys)
        elif out.preempted:
            # Preempted requests keep their age order at the front of the queue.
            front = list(self.scheduler.waiting)[: len(out.preempted)]
            assert front == list(reversed(out.preempted))

    def _check_accounting(self) -> None:
        self.pool.check_invariants()
        live = self.scheduler.running
        assert sum(self.pool.ref_count(b) for b in range(self.pool.num_blocks)) == sum(len(r.block_table) for r in live)
        for request in live:
            assert len(set(request.block_table)) == len(request.block_table)
        for request in self.scheduler.waiting:
            assert request.block_table == []
        for request in self.requests:
            if request.is_finished:
                assert request.block_table == []
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks

    def check_all_done(self) -> None:
        assert sorted(self.finished) == sorted(r.request_id for r in self.requests)
        for request in self.requests:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.num_output_tokens == self.outputs_wanted[request.request_id]
        assert self.pool.num_used_blocks == 0


def distinct_prompt(index: int, length: int) -> list[int]:
    return [(1000 * (index + 1) + i) % 50_000 for i in range(length)]


# ------------------------------------------------------------------------------------------ tests


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="prefill_only_step_tokens"):
        SchedulerConfig(prefill_only_step_tokens=-1)
    with pytest.raises(ValueError, match="prefill_order must be one of fcfs, shortest, got 'lifo'"):
        SchedulerConfig(prefill_order="lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'sjf'"):
        SchedulerConfig(scheduling_policy="sjf")


def test_steps_that_hold_up_no_stream_take_the_prefill_only_budget() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=8, prefill_only_step_tokens=32)
    first = sim.add(distinct_prompt(0, 40), num_outputs=4)
    out = sim.step()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(first, 32)]  # nothing streams yet
    out = sim.step()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(first, 8)]  # the prompt's rest
    second = sim.add(distinct_prompt(1, 40), num_outputs=2)
    out = sim.step()
    # `first` streams now: the step keeps to max_num_batched_tokens, its decode first.
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(first, 1), (second, 7)]
    sim.run(max_steps=50)
    sim.check_all_done()


def test_the_step_budget_follows_the_streams_through_preemptions() -> None:
    """Each step's budget is checked against the streams running before it (Sim._check_output): a request
    recomputing its outputs after a preemption streams too, one alone may recompute in long steps."""
    sim = Sim(num_blocks=6, max_num_batched_tokens=4, prefill_only_step_tokens=16)
    sim.add(distinct_prompt(0, 8), num_outputs=12)
    sim.add(distinct_prompt(1, 8), num_outputs=12)
    sim.run(max_steps=400)
    assert sim.scheduler.num_preemptions > 0
    assert max(out.num_batched_tokens for out in sim.history) > 4
    sim.check_all_done()


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sim = Sim(num_blocks=16, max_num_batched_tokens=8)
    request = sim.add(distinct_prompt(0, 20), num_outputs=3)
    chunks = []
    while sim.scheduler.has_unfinished():
        out = sim.step()
        chunks.append([s.num_new_tokens for s in out.scheduled])
    assert chunks == [[8], [8], [4], [1], [1]]
    assert request.num_output_tokens == 3
    sim.check_all_done()


def test_running_decodes_are_served_before_new_prefills_and_share_the_budget() -> None:
    sim = Sim(num_blocks=32, max_num_batched_tokens=8)
    first = sim.add(distinct_prompt(0, 4), num_outputs=5)
    out = sim.step()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(first, 4)]
    second = sim.add(distinct_prompt(1, 20), num_outputs=2)
    out = sim.step()
    # The decode goes first (1 token); the new prompt gets the remaining 7 as a chunk.
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(first, 1), (second, 7)]
    out = sim.step()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(first, 1), (second, 7)]
    sim.run(max_steps=50)
    sim.check_all_done()


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    sim = Sim(num_blocks=200, max_num_batched_tokens=16, max_num_seqs=3)
    for index in range(10):
        sim.add(distinct_prompt(index, 5 + 3 * index), num_outputs=4)
    peak = 0
    while sim.scheduler.has_unfinished():
        sim.step()  # asserts budget and max_num_seqs after each step
        peak = max(peak, sim.scheduler.num_running)
        assert sim.num_steps < 200
    assert peak == 3
    assert max(o.num_batched_tokens for o in sim.history) == 16  # the budget is actually used
    sim.check_all_done()


def test_preemption_picks_newest_and_everyone_finishes() -> None:
    # Each request needs up to ceil((6 + 10 - 1) / 4) = 4 blocks; 6 blocks cannot hold three of them.
    sim = Sim(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    for index in range(3):
        sim.add(distinct_prompt(index, 6), num_outputs=10)
    sim.run(max_steps=200)
    sim.check_all_done()
    assert sim.scheduler.num_preemptions > 0
    preempted = [r.request_id for out in sim.history for r in out.preempted]
    assert preempted, "a tiny pool must force preemption"
    # The oldest request is never the victim while a newer one is running: here it never is at all.
    assert "req0" not in preempted
    assert sim.requests[0].num_preemptions == 0
    assert sum(r.num_preemptions for r in sim.requests) == sim.scheduler.num_preemptions
    # FIFO fairness survives preemption: equal requests finish in arrival order.
    assert sim.finished == ["req0", "req1", "req2"]


def test_preempted_request_recomputes_its_outputs() -> None:
    sim = Sim(num_blocks=6, block_size=4, enable_caching=False)
    for index in range(3):
        sim.add(distinct_prompt(index, 6), num_outputs=10)
    recompute_seen = False
    while sim.scheduler.has_unfinished():
        out = sim.step()
        for item in out.scheduled:
            request = item.request
            if request.num_preemptions and request.num_output_tokens and item.num_new_tokens > 1:
                # A re-admitted request recomputes prompt and generated tokens from scratch.
                recompute_seen = True
        assert sim.num_steps < 300
    assert recompute_seen
    sim.check_all_done()


@pytest.mark.parametrize("num_blocks", [200, 9])
def test_equal_requests_finish_in_fifo_order(num_blocks: int) -> None:
    sim = Sim(num_blocks=num_blocks, max_num_batched_tokens=24, max_num_seqs=3)
    for index in range(8):
        sim.add(distinct_prompt(index, 10), num_outputs=6)
    sim.run(max_steps=300)
    sim.check_all_done()
    if num_blocks < 12:  # cannot hold max_num_seqs=3 requests of 4 blocks each
        assert sim.scheduler.num_preemptions > 0
    assert sim.finished == [f"req{i}" for i in range(8)]
    steps = [sim.finish_step[f"req{i}"] for i in range(8)]
    assert steps == sorted(steps)


def test_second_request_sharing_a_prefix_hits_the_cache() -> None:
    sim = Sim(num_blocks=32, block_size=4)
    shared = distinct_prompt(0, 16)
    first = sim.add([*shared, 1, 2, 3, 4], num_outputs=8)
    sim.step()  # prefill of `first`: registers its 5 full blocks
    assert first.num_cached_tokens == 0
    second = sim.add([*shared, 9, 9, 9, 9, 9, 9], num_outputs=2)
    out = sim.step()
    assert second.num_cached_tokens == 16
    assert [s.num_new_tokens for s in out.scheduled if s.request is second] == [6]
    assert second.block_table[:4] == first.block_table[:4]
    assert all(sim.pool.ref_count(b) == 2 for b in first.block_table[:4])
    assert sim.kv.num_hit_tokens == 16
    sim.run(max_steps=50)
    sim.check_all_done()
    # After both finished, an identical prompt is served from the (free but still cached) blocks:
    # all but the last block, since the last token must be computed.
    third = sim.add([*shared, 1, 2, 3, 4], num_outputs=1)
    sim.run(max_steps=60)
    assert third.num_cached_tokens == 16
    sim.check_all_done()


def test_no_cache_hits_when_caching_is_disabled() -> None:
    sim = Sim(num_blocks=32, enable_caching=False)
    prompt = distinct_prompt(0, 17)
    sim.add(prompt, num_outputs=2)
    sim.run(max_steps=20)
    again = sim.add(prompt, num_outputs=2)
    sim.run(max_steps=40)
    assert again.num_cached_tokens == 0
    sim.check_all_done()


def scheduled(out: SchedulerOutput) -> list[tuple[Request, int]]:
    return [(s.request, s.num_new_tokens) for s in out.scheduled]


@pytest.mark.parametrize("prefill_order", ["fcfs", "shortest"])
def test_shortest_first_lets_a_short_prompt_overtake_a_long_one(prefill_order: str) -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=8, prefill_order=prefill_order)
    long = sim.add(distinct_prompt(0, 40), num_outputs=2)
    assert scheduled(sim.step()) == [(long, 8)]
    short = sim.add(distinct_prompt(1, 6), num_outputs=3)
    if prefill_order == "fcfs":
        assert scheduled(sim.step()) == [(long, 8)]
    else:
        assert scheduled(sim.step()) == [(short, 6), (long, 2)]
        # The short one streams now: its decode first, then the long prompt's chunk.
        assert scheduled(sim.step()) == [(short, 1), (long, 7)]
    sim.run(max_steps=50)
    sim.check_all_done()


def test_shortest_first_counts_cached_prefix_tokens_as_computed() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=8, prefill_order="shortest")
    cached = distinct_prompt(0, 24)
    sim.add(cached, num_outputs=1)
    sim.run(max_steps=10)
    uncached = sim.add(distinct_prompt(1, 8), num_outputs=1)
    continued = sim.add([*cached[:20], 1, 2, 3, 4], num_outputs=1)  # 20 tokens (5 blocks) from the cache
    assert scheduled(sim.step()) == [(continued, 4), (uncached, 4)]
    assert continued.num_cached_tokens == 20
    sim.run(max_steps=20)
    sim.check_all_done()


def test_shortest_first_serves_a_prompt_passed_over_too_long() -> None:
    sim = Sim(num_blocks=64, max_num_batched_tokens=4, prefill_order="shortest")
    long = sim.add(distinct_prompt(0, 20), num_outputs=1)
    first_served = None
    for index in range(1, 3 * MAX_STEPS_PASSED_OVER):
        sim.add(distinct_prompt(index, 4), num_outputs=1)  # each fills a step and finishes in it
        out = sim.step()
        if any(item.request is long for item in out.scheduled):
            first_served = sim.num_steps
            break
    assert first_served == MAX_STEPS_PASSED_OVER + 1
    sim.run(max_steps=500)
    sim.check_all_done()


def test_shortest_first_chooses_among_the_oldest_max_num_seqs_waiting() -> None:
    """Only they may start a tier load or a pull, so a long queue does not start one for every request."""
    sim = Sim(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=2, prefill_order="shortest")
    first, second = sim.add(distinct_prompt(0, 30), num_outputs=1), sim.add(distinct_prompt(1, 20), num_outputs=1)
    sim.add(distinct_prompt(2, 4), num_outputs=1)  # shortest, but third in the queue
    assert scheduled(sim.step()) == [(second, 20), (first, 30)]
    sim.run(max_steps=10)
    sim.check_all_done()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_admits_a_later_urgent_request_first(policy: str) -> None:
    sim = Sim(num_blocks=64, max_num_seqs=2, scheduling_policy=policy)
    short = sim.add(distinct_prompt(0, 4), num_outputs=2, priority=1)
    sim.add(distinct_prompt(1, 4), num_outputs=20, priority=1)
    sim.step()  # both run: the engine is full
    early = sim.add(distinct_prompt(2, 4), num_outputs=2, priority=1)
    urgent = sim.add(distinct_prompt(3, 4), num_outputs=2, priority=0)
    sim.step()
    assert short.is_finished and early.status is urgent.status is RequestStatus.WAITING
    admitted = scheduled(sim.step())[-1]  # after the running request's decode
    assert admitted == ((urgent, 4) if policy == "priority" else (early, 4))
    sim.run(max_steps=50)
    order = [name for name in sim.finished if name in (urgent.request_id, early.request_id)]
    assert order == ([urgent.request_id, early.request_id] if policy == "priority" else ["req2", "req3"])
    sim.check_all_done()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_preempts_the_least_urgent_running_request(policy: str) -> None:
    # Three 8-token prompts take 6 of the 7 blocks; the first decode to cross a block boundary takes the seventh,
    # and the next one must free a request's blocks.
    sim = Sim(num_blocks=7, block_size=4, scheduling_policy=policy)
    first = sim.add(distinct_prompt(0, 8), num_outputs=6, priority=0)
    lax = sim.add(distinct_prompt(1, 8), num_outputs=6, priority=5)
    newest = sim.add(distinct_prompt(2, 8), num_outputs=6, priority=0)
    preempted = []
    while not preempted:
        preempted = sim.step().preempted
    assert preempted == ([lax] if policy == "priority" else [newest])
    assert first.num_preemptions == 0
    sim.run(max_steps=100)
    sim.check_all_done()


def test_finishing_a_waiting_request_releases_nothing_and_removes_it() -> None:
    sim = Sim(num_blocks=16, max_num_seqs=1)
    running = sim.add(distinct_prompt(0, 5), num_outputs=3)
    waiting = sim.add(distinct_prompt(1, 5), num_outputs=3)
    sim.step()
    assert sim.scheduler.running == [running] and list(sim.scheduler.waiting) == [waiting]
    used = sim.pool.num_used_blocks
    sim.scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert sim.pool.num_used_blocks == used
    assert not sim.scheduler.waiting and waiting.is_finished
    sim.scheduler.finish(running, RequestStatus.FINISHED_ABORTED)
    assert sim.pool.num_used_blocks == 0 and not sim.scheduler.has_unfinished()
    sim.pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 5),
    enable_caching=st.booleans(),
)
def test_random_workloads_finish_within_budget(
    data: st.DataObject, block_size: int, budget: int, max_num_seqs: int, enable_caching: bool
) -> None:
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    workload = data.draw(
        st.lists(
            st.tuples(
                st.booleans(),  # starts with the shared prefix
                st.lists(st.integers(0, 3), min_size=1, max_size=10),
                st.integers(1, 6),
                st.integers(0, 3),  # arrives after this many steps of the previous arrival
            ),
            min_size=1,
            max_size=6,
        )
    )
    longest = max((len(prefix) if shared else 0) + len(tail) + n for shared, tail, n, _ in workload)
    # Enough blocks for the largest request alone; often far fewer than all of them need together.
    extra = data.draw(st.integers(0, 6))
    sim = Sim(
        num_blocks=-(-longest // block_size) + extra,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_caching=enable_caching,
        prefill_only_step_tokens=data.draw(st.sampled_from([0, 3 * budget])),
        prefill_order=data.draw(st.sampled_from(["fcfs", "shortest"])),
        scheduling_policy=data.draw(st.sampled_from(["fcfs", "priority"])),
    )
    for shared, tail, num_outputs, delay in workload:
        for _ in range(delay):
            if sim.scheduler.has_unfinished():
                sim.step()
        priority = data.draw(st.integers(-2, 2)) if sim.scheduling_policy == "priority" else 0
        sim.add((prefix if shared else []) + tail, num_outputs, priority)
    # A generous but finite bound: no request may starve and the loop may not livelock.
    sim.run(max_steps=sim.num_steps + 20 * longest * len(workload) + 50)
    sim.check_all_done()
    for request in sim.requests:
        assert request.num_cached_tokens >= 0
        assert request.num_cached_tokens % block_size == 0
        assert request.num_cached_tokens < request.num_prompt_tokens

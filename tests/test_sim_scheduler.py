"""The simulated replica's prefix cache and scheduler, driven on a virtual clock (no wall-clock timing)."""

from __future__ import annotations

import random

import pytest

from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.kvcache.events import KVEventLog
from kvyard.sim.cost_model import CostModel, StepShape, prefill_pairs
from kvyard.sim.prefix_cache import BlockTable, PrefixCache
from kvyard.sim.scheduler import SchedulerLimits, SimRequest, SimScheduler
from kvyard.sim.virtual_run import run_virtual

ROOT = KeyNamespace("sim-test", "digest", "float32", 4).root_key()
COST = CostModel(step_base_s=0.01, prefill_token_s=1e-3, attention_pair_s=1e-6, decode_seq_s=2e-3,
                 decode_context_s=1e-6)  # fmt: skip


def make_request(name: str, prompt: list[int], max_tokens: int = 1, block_size: int = 4) -> SimRequest:
    return SimRequest(name, prompt, max_tokens, ROOT, output_seed=7, block_size=block_size)


def make_scheduler(capacity: int = 64, block_size: int = 4, budget: int = 2048, max_seqs: int = 256) -> SimScheduler:
    return SimScheduler(SchedulerLimits(block_size, budget, max_seqs), PrefixCache(capacity, KVEventLog()))


def replay_events(log: KVEventLog) -> set[bytes]:
    events, complete = log.events_since(0)
    assert complete
    assert [e.seq for e in events] == list(range(1, log.last_seq + 1))  # gap-free
    cached: set[bytes] = set()
    for event in events:
        for key in event.block_keys:
            if event.kind == "stored":
                assert key not in cached
                cached.add(key)
            else:
                cached.remove(key)
    return cached


# ---------------------------------------------------------------------------- prefix cache


def test_cache_evicts_least_recently_freed_unreferenced_blocks() -> None:
    cache = PrefixCache(4)
    first: BlockTable = []
    assert cache.acquire(first, (), 3)
    keys = [b"a", b"b", b"c"]
    for index, key in enumerate(keys):
        assert cache.register(first, index, key)
    cache.release(first)  # tail first: c is evicted before b before a
    assert cache.num_used_blocks == 0 and cache.num_cached_blocks == 3
    second: BlockTable = []
    assert cache.acquire(second, [b"a"], 2)  # needs one block beyond the free one: evicts c
    assert cache.cached_keys() == [b"a", b"b"]
    assert not cache.acquire([], (), 2)  # a is referenced, b alone is evictable
    events, _ = cache.events.events_since(0)
    assert [(e.kind, e.block_keys) for e in events] == [("removed", (b"c",))]
    assert cache.num_used_blocks == 3


def test_cache_refuses_without_changing_anything() -> None:
    cache = PrefixCache(2)
    table: BlockTable = []
    assert not cache.acquire(table, (), 3)
    assert table == [] and cache.num_used_blocks == 0
    assert cache.acquire(table, (), 1)
    assert cache.register(table, 0, b"k")
    assert not cache.register([None], 0, b"k")  # a second block with the same key stays unregistered


# ---------------------------------------------------------------------------- scheduler


def test_lone_request_timing_follows_the_cost_model() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 130))
    times = run_virtual(scheduler, COST, [(1.0, make_request("a", prompt, max_tokens=3))])["a"]
    prefill = COST.prefill_seconds(30)
    assert times.ttft == pytest.approx(prefill)
    decodes = COST.decode_step_seconds(1, 31) + COST.decode_step_seconds(1, 32)
    assert times.finished == pytest.approx(1.0 + prefill + decodes)


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    scheduler = make_scheduler(budget=16)
    request = make_request("a", list(range(40)))
    scheduler.add(request)
    shapes = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        shapes.append(plan.shape)
        scheduler.complete(plan)
    assert shapes == [
        StepShape(prefill_tokens=16, prefill_pairs=prefill_pairs(16, 0)),
        StepShape(prefill_tokens=16, prefill_pairs=prefill_pairs(16, 16)),
        StepShape(prefill_tokens=8, prefill_pairs=prefill_pairs(8, 32)),
    ]


def test_decodes_are_scheduled_before_new_prefills() -> None:
    scheduler = make_scheduler(budget=10)
    decoding = make_request("old", list(range(8)), max_tokens=5)
    scheduler.add(decoding)
    scheduler.complete(scheduler.schedule())  # prefill: first token out, now decoding
    scheduler.add(make_request("new", list(range(50, 70))))
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in plan.chunks] == [("old", 1), ("new", 9)]
    assert plan.shape == StepShape(prefill_tokens=9, prefill_pairs=prefill_pairs(9, 0), decode_seqs=1,
                                   decode_context_tokens=9)  # fmt: skip


def test_repeated_prefix_hits_full_blocks_and_leaves_the_last_token() -> None:
    scheduler = make_scheduler()
    prompt = list(range(16))  # exactly four blocks of 4
    run_virtual(scheduler, COST, [(0.0, make_request("a", prompt))])
    repeat = make_request("b", prompt)
    extended = make_request("c", [*prompt, 99, 98])
    run_virtual(scheduler, COST, [(0.0, repeat), (0.0, extended)])
    assert repeat.num_cached_tokens == 12  # the last block holds the token that must be computed
    assert extended.num_cached_tokens == 16
    assert scheduler.num_hit_tokens == 28 and scheduler.num_queried_tokens == 16 + 16 + 18


def test_block_keys_are_kvyards_chained_keys() -> None:
    scheduler = make_scheduler()
    prompt = list(range(1000, 1013))
    run_virtual(scheduler, COST, [(0.0, make_request("a", prompt))])
    assert scheduler.cache.cached_keys() == chain_block_keys(ROOT, prompt, 4)


def test_output_blocks_are_cached_like_the_engine() -> None:
    scheduler = make_scheduler()
    request = make_request("a", list(range(6)), max_tokens=7)
    run_virtual(scheduler, COST, [(0.0, request)])
    assert len(request.token_ids) == 13
    # The 13th token was sampled last and never computed: three full blocks are cached.
    assert scheduler.cache.cached_keys() == chain_block_keys(ROOT, request.token_ids, 4)


def test_capacity_pressure_preempts_and_everything_still_finishes() -> None:
    scheduler = make_scheduler(capacity=10)
    requests = [make_request(f"r{i}", [i * 100 + t for t in range(10)], max_tokens=12) for i in range(3)]
    times = run_virtual(scheduler, COST, [(0.0, r) for r in requests])
    assert all(t.finished is not None for t in times.values())
    assert all(r.num_output_tokens == 12 for r in requests)
    assert scheduler.num_preemptions > 0
    assert scheduler.cache.num_used_blocks == 0
    assert replay_events(scheduler.cache.events) == set(scheduler.cache.cached_keys())


def test_abort_frees_blocks() -> None:
    scheduler = make_scheduler()
    request = make_request("a", list(range(30)), max_tokens=50)
    scheduler.add(request)
    scheduler.complete(scheduler.schedule())
    assert scheduler.cache.num_used_blocks == 8
    scheduler.abort(request)
    assert request.finish_reason == "abort"
    assert scheduler.cache.num_used_blocks == 0 and not scheduler.has_work()


@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_keep_the_accounting_consistent(seed: int) -> None:
    rng = random.Random(seed)
    budget, max_seqs = rng.choice([8, 32, 256]), rng.randint(1, 6)
    scheduler = make_scheduler(capacity=rng.randint(12, 40), budget=budget, max_seqs=max_seqs)
    prefixes = [[rng.randrange(500) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    arrivals = []
    for index in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randint(1, 12))]
        arrivals.append((rng.uniform(0, 2), make_request(f"r{index}", prompt, max_tokens=rng.randint(1, 10))))
    times = run_virtual(scheduler, COST, arrivals)
    for _, request in arrivals:
        assert request.num_output_tokens == request.max_tokens
        assert 0 <= request.num_cached_tokens <= request.num_prompt_tokens - 1
        assert times[request.request_id].ttft > 0
        assert times[request.request_id].finished is not None
    assert scheduler.cache.num_used_blocks == 0
    assert replay_events(scheduler.cache.events) == set(scheduler.cache.cached_keys())
    assert scheduler.cache.num_cached_blocks <= scheduler.cache.capacity_blocks


def test_requests_that_fill_the_cache_preempt_each_other_and_finish() -> None:
    scheduler = make_scheduler(capacity=4)
    first = make_request("a", list(range(7)), max_tokens=9)  # grows to 16 tokens: all four blocks
    second = make_request("b", list(range(100, 103)), max_tokens=6)
    times = run_virtual(scheduler, COST, [(0.0, first), (0.0, second)])
    assert first.num_output_tokens == 9 and second.num_output_tokens == 6
    assert first.num_preemptions + second.num_preemptions > 0
    assert all(t.finished is not None for t in times.values())

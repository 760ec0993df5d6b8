"""The simulated engine: the engine core with a cost runner, driven on a virtual clock (no wall-clock timing)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvyard.engine.core import EngineCore
from kvyard.engine.scheduling.scheduler import ScheduledRequest, SchedulerConfig
from kvyard.engine.scheduling.step import SampledToken
from kvyard.kvcache.block_key import chain_block_keys
from kvyard.kvcache.events import KVEventLog
from kvyard.sim.config import SimConfig
from kvyard.sim.cost_model import CostModel, StepShape, prefill_pairs
from kvyard.sim.cost_runner import CostRunner, step_shape
from kvyard.sim.tokens import output_seed, output_token
from kvyard.sim.virtual_run import Arrival, run_virtual

COST = CostModel(
    step_base_s=0.01, prefill_token_s=1e-3, attention_pair_s=1e-6, decode_seq_s=2e-3, decode_context_s=1e-6
)


class ShapeRecorder(CostRunner):
    """A cost runner that also keeps what each step ran."""

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self.shapes: list[StepShape] = []
        self.batches: list[list[tuple[str, int]]] = []

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        self.shapes.append(step_shape(scheduled))
        self.batches.append([(s.request.request_id, s.num_new_tokens) for s in scheduled])
        return super().execute(scheduled)


def make_engine(capacity: int = 64, budget: int = 2048, max_seqs: int = 256) -> tuple[EngineCore, ShapeRecorder]:
    config = SimConfig(
        model_name="sim-test",
        block_size=4,
        num_kv_blocks=capacity,
        cost=COST,
        scheduler=SchedulerConfig(budget, max_seqs),
    )
    runner = ShapeRecorder(COST)
    core = EngineCore(config.core_config(), config.namespace, runner)
    return core, runner


def replay_events(log: KVEventLog | None) -> set[bytes]:
    assert log is not None
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


def test_lone_request_timing_follows_the_cost_model() -> None:
    core, runner = make_engine()
    times = run_virtual(core, runner, [Arrival(1.0, "a", list(range(100, 130)), 3)])["a"]
    prefill = COST.prefill_seconds(30)
    assert times.ttft == pytest.approx(prefill)
    decodes = COST.decode_step_seconds(1, 31) + COST.decode_step_seconds(1, 32)
    assert times.finished == pytest.approx(1.0 + prefill + decodes)


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    core, runner = make_engine(budget=16)
    run_virtual(core, runner, [Arrival(0.0, "a", list(range(40)), 1)])
    assert runner.shapes == [
        StepShape(prefill_tokens=16, prefill_pairs=prefill_pairs(16, 0)),
        StepShape(prefill_tokens=16, prefill_pairs=prefill_pairs(16, 16)),
        StepShape(prefill_tokens=8, prefill_pairs=prefill_pairs(8, 32)),
    ]


def test_decodes_are_scheduled_before_new_prefills() -> None:
    core, runner = make_engine(budget=10)
    run_virtual(
        core,
        runner,
        [Arrival(0.0, "old", list(range(8)), 5), Arrival(COST.prefill_seconds(8), "new", list(range(50, 70)), 1)],
    )
    assert runner.batches[1] == [("old", 1), ("new", 9)]
    assert runner.shapes[1] == StepShape(
        prefill_tokens=9, prefill_pairs=prefill_pairs(9, 0), decode_seqs=1, decode_context_tokens=9
    )


def test_repeated_prefix_hits_full_blocks_and_leaves_the_last_token() -> None:
    core, runner = make_engine()
    prompt = list(range(16))  # exactly four blocks of 4
    run_virtual(core, runner, [Arrival(0.0, "a", prompt, 1)])
    outputs = {}
    for arrival in (Arrival(0.0, "b", prompt, 1), Arrival(0.0, "c", [*prompt, 99, 98], 1)):
        core.add_request(arrival.request_id, arrival.prompt_token_ids, arrival.params())
    while core.has_unfinished_requests():
        outputs.update({o.request_id: o for o in core.step()})
    assert outputs["b"].num_cached_tokens == 12  # the last block holds the token that must be computed
    assert outputs["c"].num_cached_tokens == 16
    stats = core.stats()
    assert stats.prefix_cache_hit_tokens == 28 and stats.prefix_cache_queried_tokens == 16 + 16 + 18


def test_block_keys_are_kvyards_chained_keys_and_outputs_are_deterministic() -> None:
    core, _ = make_engine()
    prompt = list(range(1000, 1006))
    core.add_request("a", prompt, Arrival(0, "a", prompt, 7).params())
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    tokens = outputs[-1].token_ids
    assert tokens == [output_token(output_seed(prompt, None), i) for i in range(7)]
    # The 13th token was sampled last and never computed: three full blocks are cached.
    assert core.block_pool.cached_block_keys() == chain_block_keys(core.root_key(None), prompt + tokens, 4)


def test_capacity_pressure_preempts_and_everything_still_finishes() -> None:
    core, runner = make_engine(capacity=10)
    arrivals = [Arrival(0.0, f"r{i}", [i * 100 + t for t in range(10)], 12) for i in range(3)]
    times = run_virtual(core, runner, arrivals)
    assert all(t.finished is not None for t in times.values())
    assert core.stats().num_preemptions > 0 and core.stats().kv_blocks_used == 0
    assert replay_events(core.kv_event_log()) == set(core.block_pool.cached_block_keys())


@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_keep_the_accounting_consistent(seed: int) -> None:
    rng = random.Random(seed)
    budget, max_seqs = rng.choice([8, 32, 256]), rng.randint(1, 6)
    core, runner = make_engine(capacity=rng.randint(12, 40), budget=budget, max_seqs=max_seqs)
    prefixes = [[rng.randrange(500) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    arrivals = []
    for index in range(30):
        prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randint(1, 12))]
        arrivals.append(Arrival(rng.uniform(0, 2), f"r{index}", prompt, rng.randint(1, 10)))
    times = run_virtual(core, runner, arrivals)
    for arrival in arrivals:
        assert times[arrival.request_id].ttft > 0
        assert times[arrival.request_id].finished is not None
    assert core.stats().kv_blocks_used == 0
    assert replay_events(core.kv_event_log()) == set(core.block_pool.cached_block_keys())
    core.block_pool.check_invariants()


def test_requests_that_fill_the_cache_preempt_each_other_and_finish() -> None:
    core, runner = make_engine(capacity=4)
    first = Arrival(0.0, "a", list(range(7)), 9)  # grows to 16 tokens: all four blocks
    second = Arrival(0.0, "b", list(range(100, 103)), 6)
    times = run_virtual(core, runner, [first, second])
    assert core.stats().num_preemptions > 0
    assert all(t.finished is not None for t in times.values())

"""The simulator stands in for the engine: same block keys, and the same scheduling, caching and eviction.

The simulated replica runs the engine's own core with a cost runner in place of the model. Fed the same
timed request sequence as a real engine on a tiny model, it must schedule the same batches, report the
same cached tokens, preempt the same requests and evict as many blocks (the same ones, where a block holds
only prompt tokens: generated tokens differ), step by step.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvyard.cli.sim import add_sim_arguments, sim_config
from kvyard.engine.config import EngineConfig
from kvyard.engine.core import EngineCore
from kvyard.engine.llm_engine import LLMEngine
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest
from kvyard.engine.scheduling.step import Runner, SampledToken
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys
from kvyard.models.loader import model_digest
from kvyard.testing.sim_cluster import SimCluster
from tests.server_utils import ADMIN, ServerProcess, start_server

PROMPTS = [[(i * 37 + 11) % 500 + 3 for i in range(45)], [(i * 53 + 7) % 500 + 3 for i in range(33)]]
BLOCK_SIZE, NUM_BLOCKS, BUDGET, MAX_SEQS = 16, 16, 40, 5


@pytest.fixture(scope="module")
def real_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(llama_dir, tmp_path_factory.mktemp("parity"), "--block-size", "16")
    yield server
    server.stop()


def sim_config_for(llama_dir: Path, *arguments: str) -> Any:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return sim_config(parser.parse_args(["--namespace-from", str(llama_dir), *arguments]))


def stored_keys(url: str) -> list[str]:
    page: dict[str, Any] = httpx.get(f"{url}/kv/events", headers=ADMIN, params={"since": 0, "stream": False}).json()
    return [
        key
        for event in page["events"]
        if (event["type"], event["medium"]) == ("stored", "device")
        for key in event["block_keys"]
    ]


def test_sim_block_keys_equal_a_real_replicas(real_server: ServerProcess, llama_dir: Path) -> None:
    config = sim_config_for(llama_dir, "--time-scale", "0.01")
    assert (config.model_name, config.model_digest) == (llama_dir.name, model_digest(llama_dir))
    with SimCluster([config]) as sim:
        for tokens in PROMPTS:
            for url in (real_server.url, sim.urls[0]):
                body = {"prompt": tokens, "max_tokens": 1, "cache_salt": "tenant-7"}
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        real, simulated = stored_keys(real_server.url), stored_keys(sim.urls[0])
        real_snapshot = httpx.get(f"{real_server.url}/kv/snapshot", headers=ADMIN).json()
        sim_snapshot = httpx.get(f"{sim.urls[0]}/kv/snapshot", headers=ADMIN).json()
    assert simulated == real and len(real) == 2 + 2
    assert sim_snapshot["namespace"] == real_snapshot["namespace"]
    root = KeyNamespace(**real_snapshot["namespace"]).with_salt("tenant-7").root_key()
    expected = [key.hex() for tokens in PROMPTS for key in chain_block_keys(root, tokens, 16)]
    assert real == expected


# ---------------------------------------------------------------------------- step by step


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    batch: tuple[tuple[str, int], ...]  # (request, tokens computed) in the order the runner got them
    preempted: int
    cached_tokens: tuple[tuple[str, int], ...]  # requests admitted for the first time, with their prefix hit
    stored: int
    removed: int
    removed_prompt_blocks: frozenset[bytes]  # evicted blocks that hold prompt tokens only (equal keys in both)


@dataclass(slots=True)
class Recorder:
    """Wraps a runner to see each step's batch."""

    inner: Runner
    batches: list[tuple[tuple[str, int], ...]] = field(default_factory=list)

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        self.batches.append(tuple((s.request.request_id, s.num_new_tokens) for s in scheduled))
        return self.inner.execute(scheduled)

    def release(self, request: Request) -> None:
        self.inner.release(request)


def workload(seed: int) -> list[Arrival]:
    """Shared prefixes (prefix hits), chunked prompts, and more KV than the pool holds (preemption, eviction)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randint(16, 40))] for _ in range(3)]
    arrivals = []
    for index in range(16):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 50))]
        arrivals.append(Arrival(rng.randint(0, 30), f"r{index}", prompt, rng.randint(2, 40)))
    return sorted(arrivals, key=lambda a: a.step)


def run_steps(core: EngineCore, arrivals: list[Arrival]) -> list[StepRecord]:
    recorder = Recorder(core.runner)
    core.runner = recorder
    prompt_blocks = {key for a in arrivals for key in chain_block_keys(core.root_key(None), a.prompt, BLOCK_SIZE)}
    log = core.kv_event_log()
    assert log is not None
    records, pending, step, seen = [], list(arrivals), 0, set()
    while pending or core.has_unfinished_requests():
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
            core.add_request(arrival.request_id, arrival.prompt, params)
        seq, preemptions, num_batches = log.last_seq, core.stats().num_preemptions, len(recorder.batches)
        core.step()
        events, _ = log.events_since(seq)
        removed = [key for e in events if e.kind == "removed" for key in e.block_keys]
        admitted = [r for r in core.scheduler.running if r.request_id not in seen]
        seen.update(r.request_id for r in admitted)
        records.append(
            StepRecord(
                batch=recorder.batches[-1] if len(recorder.batches) > num_batches else (),
                preempted=core.stats().num_preemptions - preemptions,
                cached_tokens=tuple((r.request_id, r.num_cached_tokens) for r in admitted),
                stored=sum(len(e.block_keys) for e in events if e.kind == "stored"),
                removed=len(removed),
                removed_prompt_blocks=frozenset(key for key in removed if key in prompt_blocks),
            )
        )
        step += 1
    return records


@pytest.mark.parametrize("seed", [0, 1])
def test_sim_schedules_caches_and_evicts_step_by_step_like_the_engine(llama_dir: Path, seed: int) -> None:
    config = EngineConfig.create(
        llama_dir,
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_BLOCKS,
        record_kv_events=True,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=MAX_SEQS,
    )
    engine = LLMEngine(config)
    sim = sim_config_for(
        llama_dir,
        "--block-size",
        str(BLOCK_SIZE),
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--max-num-batched-tokens",
        str(BUDGET),
        "--max-num-seqs",
        str(MAX_SEQS),
    )
    sim = replace(sim, max_model_len=engine.max_model_len, vocab_size=engine.limits.vocab_size)
    sim_core, _ = sim.build_core()
    assert sim_core.root_key(None) == engine.root_key(None)
    arrivals = workload(seed)
    real, simulated = run_steps(engine, arrivals), run_steps(sim_core, arrivals)
    assert sum(r.preempted for r in real) > 0 and sum(r.removed for r in real) > 0  # the test exercises both
    assert sum(bool(r.removed_prompt_blocks) for r in real) > 0
    assert sum(n for r in real for _, n in r.cached_tokens) > 0
    assert len(simulated) == len(real)
    for step, (sim_step, real_step) in enumerate(zip(simulated, real)):
        assert sim_step == real_step, f"step {step} differs"

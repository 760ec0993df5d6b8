"""KV-tier loads run off the engine thread: a stalled store delays only the request waiting for its blocks."""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_utils import RedisProcess, start_redis

from kvyard import LLM, SamplingParams
from kvyard.engine.core import RequestOutput
from kvyard.kvcache import KVTierConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
STEPS_DURING_STALL = 30


def _prompt(seed: int, length: int = 300) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 1000) for _ in range(length)]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = start_redis(tmp_path)
    yield server
    server.process.send_signal(signal.SIGCONT)
    server.kill()


def _tokens(outputs: list[RequestOutput], request_id: str) -> int:
    return sum(len(output.new_token_ids) for output in outputs if output.request_id == request_id)


def test_a_stalled_store_holds_back_only_the_request_loading_from_it(
    llama_dir: Path, redis_server: RedisProcess
) -> None:
    # Patient timeouts: the load must wait for the stall to end, whatever this machine's speed.
    tier = KVTierConfig(tiers=("redis",), redis_url=redis_server.url, redis_timeout_s=120, load_deadline_s=120)
    stored = _prompt(1)
    with LLM(str(llama_dir), kv_tier=tier) as writer:
        expected = writer.generate([stored], GREEDY)[0]
    with LLM(str(llama_dir), kv_tier=tier) as reader:
        engine = reader.engine
        engine.add_request("running", _prompt(2), LONG)
        outputs = engine.step()  # admitted (a quick miss in Redis) and prefilled
        redis_server.process.send_signal(signal.SIGSTOP)
        engine.add_request("loading", stored, GREEDY)
        for _ in range(STEPS_DURING_STALL):
            outputs += engine.step()
        assert _tokens(outputs, "running") >= STEPS_DURING_STALL  # it kept decoding, one token a step
        assert _tokens(outputs, "loading") == 0 and engine.scheduler.num_waiting == 1
        redis_server.process.send_signal(signal.SIGCONT)
        while engine.has_unfinished_requests():
            outputs += engine.step()
    loaded = [output for output in outputs if output.request_id == "loading"][-1]
    assert loaded.token_ids == expected.token_ids
    assert loaded.num_cached_tokens == (len(stored) - 1) // 16 * 16  # every full block came from Redis

"""Run a simulated replica's engine core on a virtual clock, as fast as the CPU allows.

Used for calibration and tests: the same core and cost runner as the real-time replica, with
arrivals given as virtual times, so timings come out exactly and repeatably.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvyard.engine.core import EngineCore
from kvyard.engine.sampling.params import SamplingParams
from kvyard.sim.cost_runner import CostRunner

MAX_IDLE_STEPS = 1000


@dataclass(frozen=True, slots=True)
class Arrival:
    time: float
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float:
        if self.first_token is None:
            raise ValueError("the request produced no token")
        return self.first_token - self.arrival


def run_virtual(core: EngineCore, runner: CostRunner, arrivals: Iterable[Arrival]) -> dict[str, RequestTimes]:
    """Serve every request to completion; per request id, when it arrived, got its first token and finished."""
    pending = sorted(arrivals, key=lambda arrival: arrival.time)
    times = {arrival.request_id: RequestTimes(arrival.time) for arrival in pending}
    now, next_arrival, idle_steps = 0.0, 0, 0
    while next_arrival < len(pending) or core.has_unfinished_requests():
        while next_arrival < len(pending) and pending[next_arrival].time <= now:
            arrival = pending[next_arrival]
            core.add_request(arrival.request_id, arrival.prompt_token_ids, arrival.params(), arrival.cache_salt)
            next_arrival += 1
        if not core.has_unfinished_requests():
            now = pending[next_arrival].time
            continue
        steps_before = runner.num_steps
        outputs = core.step()
        if runner.num_steps == steps_before:  # only preemptions: the next schedule admits them again
            idle_steps += 1
            if idle_steps > MAX_IDLE_STEPS:
                raise RuntimeError("the engine makes no progress: a request never fits in the cache")
            continue
        idle_steps = 0
        now += runner.last_step_seconds
        for output in outputs:
            request_times = times[output.request_id]
            if request_times.first_token is None:
                request_times.first_token = now
            if output.finished:
                request_times.finished = now
    return times

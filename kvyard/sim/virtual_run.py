"""Run a simulated replica's scheduler on a virtual clock, as fast as the CPU allows.

Used for calibration and tests: the same scheduler and cost model as the real-time replica, with
arrivals given as virtual times, so timings come out exactly and repeatably.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvyard.sim.cost_model import CostModel
from kvyard.sim.scheduler import SimRequest, SimScheduler


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


def run_virtual(
    scheduler: SimScheduler, cost: CostModel, arrivals: Iterable[tuple[float, SimRequest]]
) -> dict[str, RequestTimes]:
    """Serve every request to completion; per request id, when it arrived, got its first token and finished."""
    pending = sorted(arrivals, key=lambda item: item[0])
    times = {request.request_id: RequestTimes(arrival) for arrival, request in pending}
    now, next_arrival = 0.0, 0
    while next_arrival < len(pending) or scheduler.has_work():
        while next_arrival < len(pending) and pending[next_arrival][0] <= now:
            scheduler.add(pending[next_arrival][1])
            next_arrival += 1
        if not scheduler.has_work():
            now = pending[next_arrival][0]
            continue
        plan = scheduler.schedule()
        if plan.preempted and not plan.chunks:
            continue
        if not plan.chunks:
            raise RuntimeError("the scheduler cannot make progress: a request does not fit in the cache")
        now += cost.step_seconds(plan.shape)
        for output in scheduler.complete(plan):
            request_times = times[output.request.request_id]
            if request_times.first_token is None:
                request_times.first_token = now
            if output.finished:
                request_times.finished = now
    return times

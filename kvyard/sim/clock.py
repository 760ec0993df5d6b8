"""When a simulated replica's steps end, in wall time: the cost model's schedule, kept through short stalls.

Every step ends its cost (times `time_scale`) after the previous one, not after the moment the process got round to
it. The replicas of one `kvyard sim` process share an event loop, and on a small machine the loop stalls now and
then (a long prompt hashed, a garbage collection, the router and the client taking both cores). A replica that
falls less than `catch_up_s` behind runs its next steps back to back until it is on schedule again, so its tokens
keep the modeled times and a request's time per output token does not grow with the machine's noise; its tokens
arrive up to `catch_up_s` late meanwhile. A replica further behind starts again from the present: the time it
skips counts as lag, which the benchmarks report.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepClock:
    catch_up_s: float
    step_end: float | None = None  # wall time the last scheduled step ends (None: no step yet)
    lag_s: float = 0.0  # wall seconds skipped when the replica fell more than catch_up_s behind
    busy_s: float = 0.0  # wall seconds of steps scheduled

    def restart(self, now: float) -> None:
        """After a wait with nothing to run: the next step starts when it is scheduled, not when the last ended."""
        self.step_end = now

    def schedule(self, now: float, seconds: float) -> float:
        """A step that takes `seconds` of wall time, run at wall time `now`: the wall time it ends."""
        start = now if self.step_end is None else self.step_end
        if start < now - self.catch_up_s:
            self.lag_s += now - start
            start = now
        self.step_end = start + seconds
        self.busy_s += seconds
        return self.step_end

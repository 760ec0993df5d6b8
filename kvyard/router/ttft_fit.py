"""A replica's speed as the router sees it, fitted from the first-token times of the streams it sends there.

kvyard's replicas report their own step times (`/load`); another engine's do not, and its speed is not kvyard's.
For those, every streamed request is a sample: the prefill work the router predicted ahead of its first token
(prefills queued there plus its own, in prefill-token equivalents, `CacheAware`), the requests running there
(decoding: each shares the steps the new prefill runs in), and the seconds its first byte took. A least-squares
plane through the recent samples,

    seconds = overhead + s_per_token * prefill_work + s_per_running * running,

gives the replica's seconds per prefill token and what a running request costs it in prefill tokens
(s_per_running / s_per_token). On a CPU, where a vLLM server's detokenizing and streaming share the cores with its
engine, a running request was measured to weigh hundreds of prefill tokens, where kvyard's own engine weighs 16.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES = 16
WINDOW = 256  # recent samples: a replica's speed changes with its batch sizes and the prompts' lengths
MIN_WORK = 16.0  # samples with less predicted work mostly measure the overhead
MAX_RUNNING_COST = 4096.0  # prefill tokens: a bound on what noise can make a running request weigh
REFIT_EVERY = 8  # new samples between two fits (a fit costs a least-squares solve over the window)


@dataclass(slots=True)
class TtftFit:
    samples: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _fit: tuple[float, float] = (0.0, 0.0)  # (seconds per prefill token, prefill tokens per running request)
    _new: int = 0  # samples since the last fit

    def observe(self, prefill_work: float, running: int, seconds: float) -> None:
        if prefill_work >= MIN_WORK and seconds > 0.0:
            self.samples.append((prefill_work, float(running), seconds))
            self._new += 1

    @property
    def s_per_token(self) -> float:
        """Seconds per prefill-token equivalent; 0 until enough samples (the fleet's figure is used meanwhile)."""
        return self._fitted()[0]

    @property
    def running_cost(self) -> float | None:
        """How much a running request delays a new prefill there, in prefill tokens; None until fitted."""
        s_per_token, running_cost = self._fitted()
        return running_cost if s_per_token > 0 else None

    def _fitted(self) -> tuple[float, float]:
        if self._new >= REFIT_EVERY or (self._new and len(self.samples) <= MIN_SAMPLES):
            self._fit = self._solve()
            self._new = 0
        return self._fit

    def _solve(self) -> tuple[float, float]:
        if len(self.samples) < MIN_SAMPLES:
            return 0.0, 0.0
        data = np.array(self.samples)
        work, running, seconds = data[:, 0], data[:, 1], data[:, 2]
        if np.ptp(running) > 0:
            design = np.column_stack([np.ones(len(data)), work, running])
            (_, per_token, per_running), *_ = np.linalg.lstsq(design, seconds, rcond=None)
        else:  # the running count never varied: it cannot be told apart from the overhead
            design = np.column_stack([np.ones(len(data)), work])
            (_, per_token), *_ = np.linalg.lstsq(design, seconds, rcond=None)
            per_running = 0.0
        if per_token <= 0.0:  # the work hardly varied, or noise hid it: time per unit of work, overhead included
            return float(seconds.mean() / work.mean()), 0.0
        return float(per_token), float(min(max(per_running, 0.0) / per_token, MAX_RUNNING_COST))

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

The plane is fitted twice: samples far off the first fit (beyond OUTLIER_SIGMAS robust deviations, from the median
absolute residual) are left out of the second. A replica stalled by something the plane does not see (a neighbour
on its core, a pause of the machine) gives first-token times of seconds where the plane predicts a tenth; on a
2-core VM with two vLLM servers a core, a few such samples moved a least-squares fit of the running request's weight
from 38 to 3,108 prefill tokens within a minute, and the router then shunned every replica with a stream running.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES = 16
WINDOW = 256  # recent samples: a replica's speed changes with its batch sizes and the prompts' lengths
MIN_WORK = 16.0  # samples with less predicted work mostly measure the overhead
MAX_RUNNING_COST = 4096.0  # prefill tokens: a bound on what noise can make a running request weigh
REFIT_EVERY = 8  # new samples between two fits (a fit costs two least-squares solves over the window)
OUTLIER_SIGMAS = 4.0  # residuals beyond this many robust standard deviations are left out of the second fit
SPREAD_FLOOR = 1e-3  # the least deviation counted, as a share of the mean first-token time
_MAD_TO_SIGMA = 1.4826  # the median absolute deviation of normal noise times this is its standard deviation


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
        kept = _without_outliers(data, _plane(data))
        if len(kept) >= MIN_SAMPLES:
            data = kept
        per_token, per_running = _plane(data)
        if per_token <= 0.0:  # the work hardly varied, or noise hid it: time per unit of work, overhead included
            return float(data[:, 2].mean() / data[:, 0].mean()), 0.0
        return float(per_token), float(min(max(per_running, 0.0) / per_token, MAX_RUNNING_COST))


def _design(data: np.ndarray) -> np.ndarray:
    """Overhead, work and (when the running count varied; otherwise it cannot be told from the overhead) running."""
    columns = [np.ones(len(data)), data[:, 0]]
    if np.ptp(data[:, 1]) > 0:
        columns.append(data[:, 1])
    return np.column_stack(columns)


def _plane(data: np.ndarray) -> tuple[float, float]:
    """Least-squares seconds per unit of work and per running request (0 when the running count never varied)."""
    coefficients, *_ = np.linalg.lstsq(_design(data), data[:, 2], rcond=None)
    return float(coefficients[1]), float(coefficients[2]) if len(coefficients) > 2 else 0.0


def _without_outliers(data: np.ndarray, plane: tuple[float, float]) -> np.ndarray:
    """The samples within OUTLIER_SIGMAS robust deviations of the plane (its overhead refitted as their median)."""
    predicted = plane[0] * data[:, 0] + plane[1] * data[:, 1]
    residual = data[:, 2] - predicted
    residual -= _median(residual)
    # The floor: samples on the plane to rounding (no noise at all) have no spread to measure deviations by.
    spread = max(_MAD_TO_SIGMA * _median(np.abs(residual)), SPREAD_FLOOR * float(np.mean(data[:, 2])))
    return data[np.abs(residual) <= OUTLIER_SIGMAS * spread]


def _median(values: np.ndarray) -> float:
    """np.median's value; np.median itself imports numpy.ma on its first call, 26 ms on the router's event loop."""
    ordered = np.sort(values)
    return float(ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2.0

"""A replica's speed as the router sees it: seconds per prefill-token equivalent, fitted from first-token times.

kvyard's replicas report their own step times (`/load`); another engine's do not, and its speed is not kvyard's.
For those, every streamed request the router sends is a sample: the work the router predicted ahead of its first
token (the replica's queue plus the request's own prefill, in prefill-token equivalents, `CacheAware`) against
the seconds its first byte took. A least-squares line through the recent samples gives seconds per token (its
slope: what more work costs) and a fixed overhead (its intercept: the HTTP round trip, tokenization, a scheduler
step); only the slope is used, since routing compares replicas by the work they would do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_SAMPLES = 8
WINDOW = 256  # recent samples: a replica's speed changes with its batch sizes and the prompts' lengths
MIN_WORK = 16.0  # samples with less predicted work mostly measure the overhead


@dataclass(slots=True)
class TtftFit:
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))  # (work, seconds)
    _slope: float = 0.0
    _stale: bool = False

    def observe(self, work: float, seconds: float) -> None:
        if work >= MIN_WORK and seconds > 0.0:
            self.samples.append((work, seconds))
            self._stale = True

    @property
    def s_per_token(self) -> float:
        """Seconds per prefill-token equivalent; 0 until enough samples (the fleet's figure is used meanwhile)."""
        if self._stale:
            self._slope = self._fit()
            self._stale = False
        return self._slope

    def _fit(self) -> float:
        count = len(self.samples)
        if count < MIN_SAMPLES:
            return 0.0
        mean_work = sum(work for work, _ in self.samples) / count
        mean_seconds = sum(seconds for _, seconds in self.samples) / count
        spread = sum((work - mean_work) ** 2 for work, _ in self.samples)
        covariance = sum((work - mean_work) * (seconds - mean_seconds) for work, seconds in self.samples)
        slope = covariance / spread if spread > 0 else 0.0
        if slope <= 0.0:  # the work hardly varied (or noise hid it): time per unit of work, overhead included
            slope = mean_seconds / mean_work
        return slope

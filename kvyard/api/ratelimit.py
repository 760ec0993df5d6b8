"""Per-client rate limits: requests and tokens per minute, as token buckets, refused with 429 and `Retry-After`.

Each client (its API key, else its address) has a bucket per limit that refills continuously at the
limit's rate and holds at most `BURST_S` seconds of it, so a client may burst briefly but not sustain more
than its rate. A request takes one unit from the request bucket and its token count (prompt plus
`max_tokens`) from the token bucket; if either lacks it, nothing is taken and the answer is 429 with the
seconds until it would fit.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvyard.api.errors import APIError

BURST_S = 10.0  # a bucket holds this many seconds of its rate
MAX_CLIENTS = 65536  # buckets kept; the least recently seen client's is dropped (it starts full again)


@dataclass(slots=True)
class TokenBucket:
    per_s: float
    level: float
    updated: float

    @property
    def capacity(self) -> float:
        return max(1.0, self.per_s * BURST_S)

    def shortfall_s(self, amount: float, now: float) -> float:
        """Refill to `now`; 0 if `amount` is there now, else the seconds until it would be."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.per_s)
        self.updated = now
        return 0.0 if self.level >= amount else (amount - self.level) / self.per_s


@dataclass(slots=True)
class RateLimiter:
    requests_per_min: float | None = None
    tokens_per_min: float | None = None
    _clients: OrderedDict[str, list[TokenBucket]] = field(default_factory=OrderedDict)

    @property
    def enabled(self) -> bool:
        return bool(self.requests_per_min or self.tokens_per_min)

    def admit(self, client: str, num_tokens: int = 0, now: float | None = None) -> None:
        """Take one request and `num_tokens` from the client's buckets, or raise 429 taking nothing."""
        if not self.enabled:
            return
        now = time.monotonic() if now is None else now
        buckets = self._buckets(client, now)
        # A request larger than a full bucket is let through when the bucket is full, never refused forever.
        amounts = [min(amount, bucket.capacity) for bucket, amount in zip(buckets, self._amounts(num_tokens))]
        wait_s = max(bucket.shortfall_s(amount, now) for bucket, amount in zip(buckets, amounts))
        if wait_s > 0:
            raise APIError(
                429,
                f"rate limit of this API key exceeded ({self._describe()}); retry in {wait_s:.1f} s",
                code="rate_limited",
                retry_after=max(1, math.ceil(wait_s)),
            )
        for bucket, amount in zip(buckets, amounts):
            bucket.level -= amount

    def _amounts(self, num_tokens: int) -> list[float]:
        amounts = []
        if self.requests_per_min:
            amounts.append(1.0)
        if self.tokens_per_min:
            amounts.append(float(num_tokens))
        return amounts

    def _buckets(self, client: str, now: float) -> list[TokenBucket]:
        buckets = self._clients.get(client)
        if buckets is None:
            rates = [rate / 60 for rate in (self.requests_per_min, self.tokens_per_min) if rate]
            buckets = self._clients[client] = [TokenBucket(rate, max(1.0, rate * BURST_S), now) for rate in rates]
            if len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        return buckets

    def _describe(self) -> str:
        parts = []
        if self.requests_per_min:
            parts.append(f"{self.requests_per_min:g} requests/min")
        if self.tokens_per_min:
            parts.append(f"{self.tokens_per_min:g} tokens/min")
        return ", ".join(parts)

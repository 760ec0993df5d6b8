"""Latency and throughput arithmetic on request records: pure functions, no I/O.

Definitions (all per request, then aggregated):
- TTFT: first chunk carrying output minus the moment the request was handed to the HTTP client.
- TPOT: (last output chunk - first output chunk) / (output tokens - 1), i.e. the first token excluded;
  undefined for a one-token answer.
- ITL: gaps between consecutive output chunks (a chunk can carry more than one token).
- E2E: response fully read minus request start.
- Percentiles interpolate linearly between the closest ranks (numpy's default method).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvyard.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request service-level objectives in seconds; None means no bound."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        ttft, per_token = record.ttft, tpot(record)
        if self.ttft is not None and (ttft is None or ttft > self.ttft):
            return False
        if self.tpot is not None and per_token is not None and per_token > self.tpot:
            return False
        return self.e2e is None or record.e2e <= self.e2e


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(text: str) -> SLO:
    """`ttft=500ms,tpot=50ms,e2e=10s`; a bare number is milliseconds."""
    bounds: dict[str, float] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--slo: expected ttft=…, tpot=… or e2e=…, got {item.strip()!r}")
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(f"--slo: {name} needs a duration like 500ms or 0.5s, got {value.strip()!r}")
        number, unit = float(match.group(1)), match.group(2) or "ms"
        bounds[name] = number / 1000 if unit == "ms" else number
    if not bounds:
        raise ValueError("--slo: give at least one of ttft, tpot, e2e")
    return SLO(**bounds)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """count, mean, min, max and the standard percentiles; None when there is nothing to describe."""
    if not values:
        return None
    summary = {"count": float(len(values)), "mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    summary.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return summary


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first one."""
    if record.output_tokens < 2 or len(record.token_times) < 1:
        return None
    return (record.token_times[-1] - record.token_times[0]) / (record.output_tokens - 1)


def inter_token_latencies(record: RequestRecord) -> list[float]:
    times = record.token_times
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def prompt_tokens(record: RequestRecord) -> int:
    """What the server says it processed when it says so, else what the client sent."""
    return record.prompt_tokens if record.server_prompt_tokens is None else record.server_prompt_tokens


def span(records: Iterable[RequestRecord]) -> float:
    """Seconds from the first request's start to the last one's end."""
    listed = list(records)
    if not listed:
        return 0.0
    return max(r.end for r in listed) - min(r.start for r in listed)


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    duration = span(records)
    output = sum(r.output_tokens for r in done)
    prompt = sum(prompt_tokens(r) for r in done)
    return {
        "requests": {"total": len(records), "completed": len(done), "failed": len(records) - len(done)},
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
        "duration_s": duration,
        "ttft_s": distribution([t for r in done if (t := r.ttft) is not None]),
        "tpot_s": distribution([t for r in done if (t := tpot(r)) is not None]),
        "itl_s": distribution([gap for r in done for gap in inter_token_latencies(r)]),
        "e2e_s": distribution([r.e2e for r in done]),
        "tokens": {"prompt": prompt, "output": output},
        "short_outputs": sum(1 for r in done if r.output_tokens < r.max_tokens),
        "send_lag_s": distribution([r.start - r.scheduled for r in records if r.scheduled is not None]),
        "throughput": {
            "requests_per_s": _rate(len(done), duration),
            "input_tokens_per_s": _rate(prompt, duration),
            "output_tokens_per_s": _rate(output, duration),
            "total_tokens_per_s": _rate(prompt + output, duration),
        },
        "prefix_cache": prefix_cache(done),
        "goodput": goodput(records, slo, duration) if slo is not None else None,
    }


def prefix_cache(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """Measured hit ratio from usage.prompt_tokens_details.cached_tokens, next to the workload's ideal."""
    reported = [r for r in done if r.cached_tokens is not None]
    prompt = sum(prompt_tokens(r) for r in done)
    reported_prompt = sum(prompt_tokens(r) for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    ideal = sum(r.ideal_cached_tokens for r in done)
    return {
        "cached_tokens": cached if reported else None,
        "hit_ratio": cached / reported_prompt if reported and reported_prompt else None,
        "requests_reporting_cached_tokens": len(reported),
        "ideal_cached_tokens": ideal,
        "ideal_hit_ratio": ideal / prompt if prompt else None,
    }


def goodput(records: Sequence[RequestRecord], slo: SLO, duration: float) -> dict[str, Any]:
    good = sum(1 for r in records if slo.met_by(r))
    return {
        "slo_s": asdict(slo),
        "good_requests": good,
        "fraction": good / len(records) if records else None,
        "requests_per_s": _rate(good, duration),
    }


def _rate(count: float, duration: float) -> float | None:
    return count / duration if duration > 0 else None

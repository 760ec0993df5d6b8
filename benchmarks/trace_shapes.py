"""Workload shapes for the routing benchmark: Mooncake-format traces (timestamp in ms, input_length,
output_length, hash_ids of 512-token blocks) generated from a few numbers, so a router is judged on many
shapes instead of the one trace it was tuned on.

A shape fixes the prompt-length distribution (log-normal: a median and the 90th percentile, cut at a maximum),
how much of the prompts an unlimited cache would hold (`reuse`, reached by choosing how often a request
continues an earlier conversation), the mean output length and how bursty arrivals are. Prompts come from
conversations: a new conversation starts with one of a few shared system-prompt blocks (popularity falls as
1/rank) or a block of its own, then text of its own; a continuing turn extends a recent conversation whose
prompt is shorter than the length drawn, so the length distribution holds whatever the reuse. The offered load
is not part of the trace: `routing.py --utilisation` scales the arrival times to it.

Two shapes follow `kvyard bench`'s closed workloads as open traces: `bench-multiturn` (sessions of six
turns, a shared system prompt, 1,500-token first turns and 400 new tokens a turn, with think time) and
`bench-shared-prefix` (groups of requests behind one long prefix each).

    .venv/bin/python benchmarks/trace_shapes.py --out-dir /tmp/shapes     # every shape, with its statistics
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from routing import ideal_hit_ratio  # an unlimited cache's hit ratio, in trace blocks, as routing.py reports it

TRACE_BLOCK = 512
RECENT_CONVERSATIONS = 256  # a continuing turn picks among the conversations of this many latest new requests
SYSTEM_PROMPTS = 8
Z90 = 1.2815515655446004  # the standard normal's 90th percentile


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    median_prompt: int
    p90_prompt: int
    max_prompt: int
    reuse: float  # target hit ratio of an unlimited cache, in trace blocks
    mean_output: int
    utilisation: float  # the load routing_shapes.py offers this shape at
    burst_factor: float = 1.0  # arrival rate in a burst over the calm rate (1: Poisson)
    burst_share: float = 0.2  # fraction of the time spent in bursts
    shared_system: float = 0.5  # chance that a new conversation starts with a shared system-prompt block


SHAPES = (
    Shape("long-tail", 2_700, 35_000, 100_000, 0.17, 200, 0.8, shared_system=0.3),
    Shape("short-chat", 1_000, 2_500, 16_000, 0.40, 300, 1.0, burst_factor=4.0),
    Shape("long-docs", 16_000, 40_000, 100_000, 0.05, 50, 0.6, shared_system=0.2),
    Shape("agentic", 8_000, 24_000, 64_000, 0.40, 100, 0.9, burst_factor=4.0),
    Shape("mixed-burst", 1_000, 20_000, 100_000, 0.10, 500, 0.8, burst_factor=6.0, shared_system=0.2),
)


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def record(self) -> dict[str, Any]:
        return {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


def generate(shape: Shape, count: int, seed: int = 0) -> list[Request]:
    """`count` requests of `shape`, with the continuation rate searched for the shape's reuse."""
    low, high = 0.0, 0.98
    best = _requests(shape, count, seed, 0.0)
    if ideal_hit_ratio(best) >= shape.reuse:
        return best
    for _ in range(14):
        middle = (low + high) / 2
        requests = _requests(shape, count, seed, middle)
        if ideal_hit_ratio(requests) < shape.reuse:
            low = middle
        else:
            high, best = middle, requests
    return best


def _requests(shape: Shape, count: int, seed: int, continue_prob: float) -> list[Request]:
    rng = random.Random(seed)
    sigma = math.log(shape.p90_prompt / shape.median_prompt) / Z90
    next_id = SYSTEM_PROMPTS
    recent: list[tuple[int, ...]] = []  # the latest prompt of each recent conversation
    lengths: list[int] = []
    requests: list[Request] = []
    for timestamp in _arrivals(shape, count, rng):
        length = min(shape.max_prompt, max(16, round(shape.median_prompt * math.exp(rng.gauss(0, sigma)))))
        shorter = [i for i, prior in enumerate(lengths) if prior < length]
        if shorter and rng.random() < continue_prob:
            slot = rng.choice(shorter)
            prefix = recent.pop(slot)
            lengths.pop(slot)
        else:
            first = _system_block(shape, rng) if rng.random() < shape.shared_system else None
            if first is None:
                first, next_id = next_id, next_id + 1
            prefix = (first,)
        blocks = math.ceil(length / TRACE_BLOCK)
        fresh = max(0, blocks - len(prefix))
        hash_ids = prefix[:blocks] + tuple(range(next_id, next_id + fresh))
        next_id += fresh
        recent.append(hash_ids)
        lengths.append(length)
        if len(recent) > RECENT_CONVERSATIONS:
            recent.pop(0)
            lengths.pop(0)
        output = max(1, round(rng.expovariate(1 / shape.mean_output)))
        requests.append(Request(timestamp, length, output, hash_ids))
    return requests


def _system_block(shape: Shape, rng: random.Random) -> int:
    weights = [1 / rank for rank in range(1, SYSTEM_PROMPTS + 1)]
    return rng.choices(range(SYSTEM_PROMPTS), weights)[0]


def _arrivals(shape: Shape, count: int, rng: random.Random) -> list[int]:
    """Arrival times in ms at a mean of one request a second: Poisson, or switching between a calm and a burst
    rate (`burst_factor` times the calm one) for `burst_share` of the time, in stretches of about 30 s."""
    calm = 1.0 / (1 - shape.burst_share + shape.burst_share * shape.burst_factor)
    stretch_s, now, times = 30.0, 0.0, []
    in_burst, switch_at = False, rng.expovariate(1 / (stretch_s * (1 - shape.burst_share)))
    while len(times) < count:
        rate = calm * (shape.burst_factor if in_burst else 1.0)
        now += rng.expovariate(rate)
        if now >= switch_at:
            now, in_burst = switch_at, not in_burst
            share = shape.burst_share if in_burst else 1 - shape.burst_share
            switch_at = now + rng.expovariate(1 / (stretch_s * share))
            continue
        times.append(round(now * 1000))
    return times


def bench_multiturn(sessions: int = 160, turns: int = 6, seed: int = 0) -> list[Request]:
    """`kvyard bench --workload multiturn` as an open trace: one shared 1,024-token system prompt, a 1,500-token
    first message, 400 new tokens and about 200 output tokens a turn (answers become history), sessions starting
    about every 2 s, 20 s (exponential) between a session's turns."""
    rng = random.Random(seed)
    requests: list[Request] = []
    next_id = 2
    for session in range(sessions):
        start = session * 2.0 + rng.random()
        hash_ids: tuple[int, ...] = (0, 1)
        length, at = 1_024 + 1_500, start
        for _ in range(turns):
            fresh = math.ceil(length / TRACE_BLOCK) - len(hash_ids)
            hash_ids += tuple(range(next_id, next_id + fresh))
            next_id += fresh
            output = max(1, round(rng.expovariate(1 / 200)))
            requests.append(Request(round(at * 1000), length, output, hash_ids))
            length += output + 400
            at += rng.expovariate(1 / 20.0)
    return sorted(requests, key=lambda request: request.timestamp_ms)


def bench_shared_prefix(count: int = 1_000, groups: int = 16, prefix: int = 4_096, seed: int = 0) -> list[Request]:
    """`kvyard bench --workload shared-prefix` as an open trace: `groups` prefixes of `prefix` tokens (group of a
    request drawn uniformly), each followed by a 256–1,024-token question; 128 output tokens; Poisson arrivals."""
    rng = random.Random(seed)
    per_prefix = prefix // TRACE_BLOCK
    next_id, now, requests = groups * per_prefix, 0.0, []
    for _ in range(count):
        group = rng.randrange(groups)
        suffix = rng.randint(256, 1_024)
        fresh = math.ceil(suffix / TRACE_BLOCK)
        hash_ids = tuple(range(group * per_prefix, (group + 1) * per_prefix)) + tuple(range(next_id, next_id + fresh))
        next_id += fresh
        now += rng.expovariate(1.0)
        requests.append(Request(round(now * 1000), prefix + suffix, 128, hash_ids))
    return requests


def statistics(requests: list[Request]) -> dict[str, float]:
    prompts = sorted(request.input_length for request in requests)
    outputs = [request.output_length for request in requests]

    def at(q: float) -> int:
        return prompts[min(len(prompts) - 1, int(q * len(prompts)))]

    return {
        "requests": len(requests),
        "prompt_p50": at(0.5),
        "prompt_p90": at(0.9),
        "prompt_p99": at(0.99),
        "prompt_max": prompts[-1],
        "mean_output": sum(outputs) / len(outputs),
        "unlimited_reuse": round(ideal_hit_ratio(requests), 4),
    }


def write(path: Path, requests: list[Request]) -> None:
    with path.open("w") as out:
        for request in requests:
            out.write(json.dumps(request.record()) + "\n")


def every_shape(count: int, seed: int) -> dict[str, tuple[dict[str, Any], list[Request]]]:
    """name -> (the shape's parameters, its requests)."""
    shapes: dict[str, tuple[dict[str, Any], list[Request]]] = {}
    for shape in SHAPES:
        shapes[shape.name] = (asdict(shape), generate(shape, count, seed))
    # Nominal loads below the others': routing.py's work estimate counts decode tokens at the batched rate, which
    # understates these decode-heavy shapes (at 0.8 nominal, bench-multiturn's median TTFT was 48 s).
    shapes["bench-multiturn"] = ({"utilisation": 0.5, "mean_output": 200}, bench_multiturn(seed=seed)[:count])
    shapes["bench-shared-prefix"] = ({"utilisation": 0.5, "mean_output": 128}, bench_shared_prefix(count, seed=seed))
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="one <shape>.jsonl per shape is written here")
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.requests <= 0:
        parser.error(f"--requests must be > 0, got {args.requests}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, (params, requests) in every_shape(args.requests, args.seed).items():
        write(args.out_dir / f"{name}.jsonl", requests)
        print(json.dumps({"shape": name, **params, **statistics(requests)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

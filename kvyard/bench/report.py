"""Text reports: the summary table of one result and the side-by-side comparison of several."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
STATS = ("mean", "p50", "p90", "p99")


def summary_table(result: dict[str, Any]) -> str:
    s = result["summary"]
    requests = s["requests"]
    lines = [
        f"kvyard bench: {result['workload']['name']} workload, {_arrival_text(result['arrivals'])}: "
        f"{requests['completed']}/{requests['total']} requests completed in {s['duration_s']:.2f} s",
        f"{'latency (ms)':<14}" + "".join(f"{name:>10}" for name in STATS),
    ]
    for label, key in LATENCIES:
        dist = s[key]
        cells = "".join(f"{dist[name] * 1000:>10.2f}" if dist else f"{'-':>10}" for name in STATS)
        lines.append(f"{label:<14}{cells}")
    t = s["throughput"]
    lines.append(
        f"throughput: {_num(t['requests_per_s'])} req/s, {_num(t['output_tokens_per_s'])} output tok/s, "
        f"{_num(t['total_tokens_per_s'])} total tok/s "
        f"({s['tokens']['prompt']} prompt + {s['tokens']['output']} output tokens)"
    )
    if (good := s.get("goodput")) is not None:
        bounds = ", ".join(f"{k}<={v * 1000:g}ms" for k, v in good["slo_s"].items() if v is not None)
        lines.append(
            f"goodput ({bounds}): {good['good_requests']}/{requests['total']} requests, "
            f"{_num(good['requests_per_s'])} req/s"
        )
    info = result["workload"].get("info", {})
    lines.append(_cache_line(s["prefix_cache"], info))
    if spec := speculation(result["server"].get("counted", {})):
        lines.append(
            f"speculative decoding: {spec['accepted_tokens']:.0f} of {spec['proposed_tokens']:.0f} proposed "
            f"tokens accepted ({spec['acceptance_rate']:.3f}), {_num(spec['mean_accepted_run'], 2)} "
            "accepted per verification"
        )
    if "rewrites" in info:
        lines.append(f"multiturn: {info['rewrites']} turns rewrote the middle of their history")
    if s["errors"]:
        lines.append("errors: " + ", ".join(f"{kind} x{count}" for kind, count in sorted(s["errors"].items())))
    if s.get("short_outputs"):
        lines.append(f"note: {s['short_outputs']} answers were shorter than max_tokens")
    if missing := result["server"].get("missing"):
        lines.append("server lacks: " + ", ".join(missing))
    return "\n".join(lines)


def _arrival_text(arrivals: dict[str, Any]) -> str:
    mode = arrivals["mode"]
    cap = f", at most {arrivals['concurrency']} in flight" if arrivals.get("concurrency") else ""
    if mode == "poisson":
        return f"Poisson arrivals at {arrivals['request_rate']:g} req/s{cap}"
    if mode == "trace":
        return f"trace arrival times{cap}"
    return f"closed loop, concurrency {arrivals.get('concurrency') or 1}"


def _cache_line(cache: dict[str, Any], info: dict[str, Any]) -> str:
    measured = "not reported by the server" if cache["hit_ratio"] is None else f"{cache['hit_ratio']:.3f}"
    line = f"prefix cache hit ratio: {measured} (ideal with unlimited cache: {_num(cache['ideal_hit_ratio'], 3)}"
    if (trace_ideal := info.get("trace_ideal_block_hit_ratio")) is not None:
        line += f"; the trace's own ideal block ratio: {trace_ideal:.3f}"
    return line + ")"


def speculation(counted: dict[str, float]) -> dict[str, float | None] | None:
    """Speculative decoding as the server counted it during the run (None: it did not speculate, or says nothing)."""
    proposed = counted.get("spec_proposed_tokens") or 0.0
    if proposed <= 0:
        return None
    accepted = counted.get("spec_accepted_tokens", 0.0)
    verifications = counted.get("spec_verifications")
    return {
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed,
        "mean_accepted_run": accepted / verifications if verifications else None,
    }


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------------------- compare


def _latency(key: str, stat: str) -> Callable[[dict[str, Any]], float | None]:
    def read(s: dict[str, Any]) -> float | None:
        return s[key][stat] * 1000 if s[key] else None

    return read


COMPARED: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("completed requests", lambda s: s["requests"]["completed"]),
    ("failed requests", lambda s: s["requests"]["failed"]),
    ("duration (s)", lambda s: s["duration_s"]),
    ("requests/s", lambda s: s["throughput"]["requests_per_s"]),
    ("output tok/s", lambda s: s["throughput"]["output_tokens_per_s"]),
    ("total tok/s", lambda s: s["throughput"]["total_tokens_per_s"]),
    *((f"{label} {stat} (ms)", _latency(key, stat)) for label, key in LATENCIES for stat in STATS),
    ("goodput req/s", lambda s: (s.get("goodput") or {}).get("requests_per_s")),
    ("prefix hit ratio", lambda s: s["prefix_cache"]["hit_ratio"]),
    ("ideal hit ratio", lambda s: s["prefix_cache"]["ideal_hit_ratio"]),
)


def compare_table(results: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """One column per result and, for every result after the first, its ratio to the first. Names too long
    for a column are shown as letters, with a legend."""
    labels = list(names) if all(len(name) <= 12 for name in names) else [chr(ord("A") + i) for i in range(len(names))]
    header = [f"{'metric':<22}"] + [f"{label:>15}" for label in labels]
    header += [f"{'x ' + label:>15}" for label in labels[1:]]
    lines = [f"{label} = {name}" for label, name in zip(labels, names) if label != name]
    lines.append("".join(header))
    for label, read in COMPARED:
        values = [read(r["summary"]) for r in results]
        cells = [f"{label:<22}"] + [f"{_cell(v):>15}" for v in values]
        base = values[0]
        cells += [f"{_ratio(v, base):>15}" for v in values[1:]]
        lines.append("".join(cells))
    lines.append("conditions:")
    for name, result in zip(names, results):
        lines.append(f"  {name}: {_conditions(result)}")
    return "\n".join(lines)


def compare_names(paths: Sequence[Path]) -> list[str]:
    stems = [p.stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 or float(value).is_integer() else f"{value:.3f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "-"
    return f"{value / base:.3f}x"


def _conditions(result: dict[str, Any]) -> str:
    p = result["provenance"]
    server = result["server"]
    return (
        f"{result['workload']['name']} {result['workload']['params']}, {_arrival_text(result['arrivals'])}; "
        f"model {server.get('model')}; commit {(p['git'].get('commit') or '?')[:10]}; "
        f"{p['host'].get('cpu_count')} CPUs; started {p['start_time']}"
    )

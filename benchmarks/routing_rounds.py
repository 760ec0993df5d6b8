"""Combine routing.py runs made one router and one round at a time into the summary `--repeats` would write.

A replay of the whole Mooncake trace takes about 36 minutes per router on a 2-core VM, so its rounds are run as
separate invocations (`routing.py --only ROUTER`), often on different days. This script reads those reports and
each one's per-request lines (`<report>.requests.jsonl.gz` or `.jsonl` beside it), and

- refuses runs whose conditions differ, naming the field (requests, time scale, tiers, arrival speed-up, ...);
- recomputes every round's headline numbers from its per-request lines with routing.py's own percentile rule and
  checks them against what the run reported, so a round cannot enter the summary with numbers it did not have;
- writes, per router, the mean, min and max over its rounds, and the issue's ratios: the subject's hit ratio
  over the unlimited cache's, its TTFT p99 over the best peer's, and whether its p50 is the lowest.

    .venv/bin/python benchmarks/routing_rounds.py benchmarks/results/routing_tiered_full_trace_peak08_loadext*.json \\
        --out benchmarks/results/routing_tiered_full_trace_rounds.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routing import SOURCES, percentile, spread

METRICS = ("hit_ratio", "ttft_p50_s", "ttft_p99_s", "ttft_excess_p50_s", "ttft_excess_p99_s", "failed", "sim_lag_s_max")
# Conditions that describe the machine or the invocation, not the experiment: they may differ between rounds.
FREE_CONDITIONS = frozenset({"rounds", "provenance"})
# Per-request lines keep TTFTs to 0.1 ms; a recomputed number may differ from the reported one by that rounding.
TTFT_TOLERANCE_S = 2e-4
HIT_RATIO_TOLERANCE = 1e-9


class RunError(ValueError):
    """A run that cannot enter the summary; the message names the file and the reason."""


@dataclass(slots=True)
class Round:
    path: Path
    router: str
    metrics: dict[str, float]
    hit_ratio_by_source: dict[str, float]
    provenance: dict[str, Any] | None  # command, commit, host and start time; runs before 2026-12-03 lack it


def per_request_path(report: Path) -> Path:
    for suffix in (".requests.jsonl.gz", ".requests.jsonl"):
        candidate = report.with_name(report.name.removesuffix(".json") + suffix)
        if candidate.is_file():
            return candidate
    raise RunError(f"{report}: no per-request lines beside it ({report.stem}.requests.jsonl[.gz])")


def read_lines(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def recompute(lines: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """A round's numbers from its per-request lines, computed as routing.py's `summarize` computes them."""
    done = [line for line in lines if line["ok"]]
    prompt = max(1, sum(line["prompt_tokens"] for line in done))
    ttfts = [line["ttft_s"] for line in done]
    excess = [line["ttft_s"] - line["floor_s"] for line in done]
    metrics = {
        "hit_ratio": sum(line["cached_tokens"] for line in done) / prompt,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "ttft_excess_p50_s": percentile(excess, 0.5),
        "ttft_excess_p99_s": percentile(excess, 0.99),
        "failed": float(len(lines) - len(done)),
    }
    by_source = {s: sum(line["cached_by_source"].get(s, 0) for line in done) / prompt for s in SOURCES}
    return metrics, by_source


def check_reported(path: Path, reported: dict[str, Any], recomputed: dict[str, float]) -> None:
    for metric, value in recomputed.items():
        if metric not in reported:
            continue  # runs before 85c17ab did not report TTFT minus its floor
        tolerance = HIT_RATIO_TOLERANCE if metric == "hit_ratio" else TTFT_TOLERANCE_S
        if abs(float(reported[metric]) - value) > tolerance:
            raise RunError(f"{path}: {metric} reported {reported[metric]} but its per-request lines give {value}")


def load_round(path: Path) -> tuple[dict[str, Any], Round]:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RunError(f"{path}: not a readable routing.py report ({error})") from error
    runs = [run for run in report.get("routing", []) if "skipped" not in run]
    if len(runs) != 1:
        raise RunError(f"{path}: holds {len(runs)} completed rounds; combine reports of one round each")
    run = runs[0]
    lines = read_lines(per_request_path(path))
    if len(lines) != report["conditions"]["requests"]:
        raise RunError(f"{path}: {len(lines)} per-request lines for {report['conditions']['requests']} requests")
    metrics, by_source = recompute(lines)
    check_reported(path, run, metrics)
    metrics["sim_lag_s_max"] = float(run.get("sim_lag_s_max", float("nan")))
    conditions = report["conditions"]
    return conditions, Round(path, run["router"], metrics, by_source, conditions.get("provenance"))


def common_conditions(loaded: list[tuple[dict[str, Any], Round]]) -> dict[str, Any]:
    first_conditions, first_round = loaded[0]
    for conditions, one in loaded[1:]:
        for key in sorted((first_conditions.keys() | conditions.keys()) - FREE_CONDITIONS):
            if first_conditions.get(key) != conditions.get(key):
                raise RunError(
                    f"{one.path}: condition {key!r} is {conditions.get(key)!r}, but "
                    f"{first_round.path} has {first_conditions.get(key)!r}"
                )
    return {key: value for key, value in first_conditions.items() if key not in FREE_CONDITIONS}


def run_row(one: Round) -> dict[str, Any]:
    return {"file": one.path.name, "router": one.router, **one.metrics, "provenance": one.provenance}


def summarize(rounds: list[Round]) -> dict[str, dict[str, Any]]:
    by_router: dict[str, list[Round]] = {}
    for one in rounds:
        by_router.setdefault(one.router, []).append(one)
    summary: dict[str, dict[str, Any]] = {}
    for router, mine in sorted(by_router.items()):
        row: dict[str, Any] = {"rounds": len(mine), "files": [one.path.name for one in mine]}
        for metric in METRICS:
            row[metric] = spread([one.metrics[metric] for one in mine])
        row["hit_ratio_by_source"] = {s: spread([one.hit_ratio_by_source[s] for one in mine]) for s in SOURCES}
        summary[router] = row
    return summary


def bars(summary: dict[str, dict[str, Any]], subject: str, unlimited: float) -> dict[str, Any]:
    """The issue's ratios on the means: hit ratio over the unlimited cache's, TTFT p99 over the best peer's."""
    if subject not in summary:
        raise RunError(f"no run of the subject router {subject!r} among: {', '.join(summary)}")
    peers = {router: row for router, row in summary.items() if router != subject}
    mine = summary[subject]
    result: dict[str, Any] = {
        "subject": subject,
        "rounds": {router: row["rounds"] for router, row in summary.items()},
        "hit_ratio_over_unlimited": mine["hit_ratio"]["mean"] / unlimited,
    }
    if peers:
        best_p99 = min(peers, key=lambda router: peers[router]["ttft_p99_s"]["mean"])
        best_p50 = min(peers, key=lambda router: peers[router]["ttft_p50_s"]["mean"])
        result |= {
            "best_peer_by_p99": best_p99,
            "ttft_p99_over_best_peer": mine["ttft_p99_s"]["mean"] / peers[best_p99]["ttft_p99_s"]["mean"],
            "ttft_excess_p99_over_best_peer": mine["ttft_excess_p99_s"]["mean"]
            / peers[best_p99]["ttft_excess_p99_s"]["mean"],
            "ttft_p50_over_lowest_peer": mine["ttft_p50_s"]["mean"] / peers[best_p50]["ttft_p50_s"]["mean"],
            "ttft_p50_lowest": all(mine["ttft_p50_s"]["mean"] < row["ttft_p50_s"]["mean"] for row in peers.values()),
        }
    return result


def table(summary: dict[str, dict[str, Any]], unlimited: float) -> str:
    def cell(row: dict[str, Any], metric: str, digits: int) -> str:
        values = row[metric]
        return f"{values['mean']:.{digits}f} ({values['min']:.{digits}f}–{values['max']:.{digits}f})"

    lines = [
        "| router | rounds | hit ratio (÷ unlimited) | TTFT p50 (s) | TTFT p99 (s) | p99 of TTFT − floor (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for router, row in summary.items():
        ratio = row["hit_ratio"]["mean"] / unlimited
        lines.append(
            f"| {router} | {row['rounds']} | {cell(row, 'hit_ratio', 4)} ({ratio:.2f}×) | "
            f"{cell(row, 'ttft_p50_s', 3)} | {cell(row, 'ttft_p99_s', 2)} | "
            f"{cell(row, 'ttft_excess_p99_s', 2)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="routing.py reports of one round each")
    parser.add_argument(
        "--subject", default="kvyard cache_aware", help="the router the ratios are about (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, help="write the combined report here (JSON)")
    args = parser.parse_args()
    try:
        loaded = [load_round(path) for path in args.reports]
        conditions = common_conditions(loaded)
        summary = summarize([one for _, one in loaded])
        unlimited = float(conditions["unlimited_cache_hit_ratio"])
        report = {
            "conditions": conditions,
            "summary": summary,
            "bars": bars(summary, args.subject, unlimited),
            "runs": [run_row(one) for _, one in loaded],
        }
    except RunError as error:
        print(f"routing_rounds.py: {error}", file=sys.stderr)
        return 2
    print(table(summary, unlimited))
    print(json.dumps(report["bars"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

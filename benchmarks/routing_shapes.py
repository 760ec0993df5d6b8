"""Routers across workload shapes: `routing.py` once per shape of `trace_shapes.py` (and on the Mooncake
conversation trace), every router on the same simulated fleet and arrivals, then one table and one picture.

Each shape is replayed over about `--replay-s` wall seconds (the sim's time scale is set per shape to make it
so) at its own offered load (`Shape.utilisation`; the bench-like shapes and the conversation trace at 0.8),
outputs uncapped up to `--max-output`, on 8 simulated replicas of 32,768 16-token blocks (the runs of record's
fleet). For each shape and router: TTFT p50, p90 and p99, and the prefix hit ratio from the replicas' usage
reports; beside them, the best of the other routers and kvyard's ratio to it.

    .venv/bin/python benchmarks/routing_shapes.py --out benchmarks/results/routing_shapes.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from trace_shapes import every_shape, statistics, write

REPO = Path(__file__).resolve().parents[1]
CONVERSATION = REPO.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
ROUTERS = (
    "kvyard cache_aware$",
    "sglang-router cache_aware",
    "smg cache_aware",
    "vllm-router cache_aware",
    "vllm-router round_robin",
)
KVYARD = "kvyard cache_aware"
DEFAULT_TIME_SCALE = 0.01  # routing.py's
METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_ratio")


def run_shape(name: str, trace: Path, utilisation: float, args: argparse.Namespace) -> dict[str, Any]:
    out = args.out.parent / "routing-shapes-logs" / name / "routing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "routing.py"),
        "--trace",
        str(trace),
        "--requests",
        str(args.requests),
        "--max-output",
        str(args.max_output),
        "--utilisation",
        str(utilisation),
        "--skip-overhead",
        "--out",
        str(out),
    ]
    # The sim's time scale that stretches this shape's replay to --replay-s of wall time: a shape of short prompts
    # replayed at the default scale would send hundreds of requests a second, and measure the HTTP stack instead.
    dry = subprocess.run([*command, "--dry-run"], check=True, capture_output=True, text=True)
    span = json.loads(dry.stdout.splitlines()[0])["replay_span_wall_s"]
    command += ["--time-scale", f"{DEFAULT_TIME_SCALE * args.replay_s / span:.5g}", "--repeats", str(args.repeats)]
    for router in args.only or ROUTERS:
        command += ["--only", router]
    print(f"[{name}] {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def table(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """Per router: the mean of each metric over its rounds; kvyard's ratio to the best other router's."""
    rows = {
        row["router"]: {metric: row[metric]["mean"] for metric in METRICS if metric in row} for row in report["summary"]
    }
    peers = {router: row for router, row in rows.items() if not router.startswith("kvyard")}
    shape: dict[str, Any] = {"shape": name, "routers": rows}
    if KVYARD in rows and peers:
        best = {metric: min(row[metric] for row in peers.values()) for metric in METRICS[:3]}
        best["hit_ratio"] = max(row["hit_ratio"] for row in peers.values())
        shape["best_peer"] = best
        shape["kvyard_over_best_peer"] = _over(rows[KVYARD], best)
        shape["kvyard_hit_minus_best_peer"] = rows[KVYARD]["hit_ratio"] - best["hit_ratio"]
        variants = {router: row for router, row in rows.items() if router.startswith(KVYARD) and router != KVYARD}
        if variants:
            shape["variants_over_best_peer"] = {router: _over(row, best) for router, row in variants.items()}
    return shape


def _over(ours: dict[str, float], best: dict[str, float]) -> dict[str, float]:
    """Ratios to the best peer (p50, p90, p99) and the hit ratio's difference from it."""
    return {
        **{metric: ours[metric] / best[metric] for metric in METRICS[:3]},
        "hit": ours["hit_ratio"] - best["hit_ratio"],
    }


def plot(shapes: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = sorted({router for shape in shapes for router in shape["routers"]}, key=lambda r: r != KVYARD)
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(routers)
    for axis, metric, label in ((axes[0], "ttft_p50_s", "TTFT p50"), (axes[1], "ttft_p99_s", "TTFT p99")):
        for index, router in enumerate(routers):
            ratios = []
            for shape in shapes:
                best = min(row[metric] for row in shape["routers"].values())
                ratios.append(shape["routers"].get(router, {}).get(metric, float("nan")) / best)
            axis.bar([i + index * width for i in range(len(shapes))], ratios, width, label=router)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], [s["shape"] for s in shapes], rotation=30)
        axis.set_ylabel(f"{label} ÷ the lowest of all routers")
        axis.set_yscale("log")
        axis.axhline(1.0, color="black", linewidth=0.5)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000, help="requests per shape")
    parser.add_argument("--max-output", type=int, default=4_096, help="cap on each request's output length")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per shape")
    parser.add_argument("--replay-s", type=float, default=80.0, help="wall seconds each replay is stretched to")
    parser.add_argument("--shape", action="append", default=[], help="only these shapes (repeatable)")
    parser.add_argument("--only", action="append", default=[], help="routers, as routing.py's --only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="keep the shapes --out already holds, run the others")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "routing_shapes.json")
    args = parser.parse_args()
    if args.requests <= 0 or args.repeats <= 0 or args.replay_s <= 0:
        parser.error("--requests, --repeats and --replay-s must be > 0")
    shapes, results = every_shape(args.requests, args.seed), []
    if args.resume and args.out.is_file():
        results = json.loads(args.out.read_text())["shapes"]
    with tempfile.TemporaryDirectory(prefix="kvyard-shapes-") as tmp:
        work = Path(tmp)
        runs: list[tuple[str, Path, float, dict[str, Any]]] = []
        for name, (params, requests) in shapes.items():
            write(work / f"{name}.jsonl", requests)
            runs.append((name, work / f"{name}.jsonl", params["utilisation"], {**params, **statistics(requests)}))
        if CONVERSATION.is_file():
            runs.append(("mooncake-conversation", CONVERSATION, 0.8, {"source": "Mooncake conversation trace"}))
        if args.shape:
            runs = sorted((run for run in runs if run[0] in args.shape), key=lambda run: args.shape.index(run[0]))
        done = {shape["shape"] for shape in results}
        for name, trace, utilisation, params in runs:
            if name in done:
                continue
            report = run_shape(name, trace, utilisation, args)
            results.append(
                {**table(name, report), "params": params, "conditions": report["conditions"], "runs": report["routing"]}
            )
            args.out.write_text(json.dumps({"shapes": results}, indent=2))
    plot(results, args.out.with_suffix(".png"))
    for shape in results:
        keys = ("shape", "kvyard_over_best_peer", "kvyard_hit_minus_best_peer")
        print(json.dumps({key: shape.get(key) for key in keys}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefill-chunk attention, one layer: the native kernel against the PyTorch (SDPA) path.

Shapes of the `bench` preset (8 query heads, 4 KV heads, head_dim 64, fp32, block size 16). Each
case runs the `prefill` of both attention backends (what the model runs per layer and chunk),
`TorchSDPABackend` and `CPUNativeBackend`, on the same inputs: q, k, v as views into one fused qkv
projection, and a paged cache whose blocks are scattered. The causal mask the PyTorch path needs
is built once per step in the metadata, outside the timed call, as in the engine.

The two paths alternate within every repetition (order flipped each time) and every case runs once
per round, so that drift on a shared machine hits both paths, and all cases, alike; the report gives
medians over all rounds of wall time and of process CPU time
(all threads), GFLOPS from the median wall time counting 4 * query_len * context_len * heads *
head_dim flops (masked pairs included), the median of the per-repetition time ratios, and the share
of the machine's CPU that other processes used meanwhile (the noise a case ran in).

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_attention_micro.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvyard.kernels.build import KernelsUnavailable

if TYPE_CHECKING:
    import torch

    from kvyard.models.attention import AttentionMetadata
    from kvyard.models.attention_backends import CPUNativeBackend

ROOT = Path(__file__).resolve().parent.parent
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
CACHED_CASES = [(q, c) for c in (1000, 2500, 4000) for q in (64, 130, 512)]  # (query_len, context_len)
WHOLE_PROMPT_CASES = [(n, n) for n in (130, 512, 1000, 2500)]


@dataclass(slots=True)
class Step:
    """One prefill chunk's inputs, set up for both paths."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    sdpa_meta: AttentionMetadata
    kernel_meta: AttentionMetadata


@dataclass(slots=True)
class Timing:
    wall_s: list[float]
    cpu_s: list[float]


def make_step(query_len: int, context_len: int, native: CPUNativeBackend, seed: int) -> Step:
    import torch  # 1 s to import, as the kvyard modules below: not before --help has had its chance

    from kvyard.models.attention import build_attention_metadata
    from kvyard.models.attention_backends import TorchSDPABackend

    generator = torch.Generator().manual_seed(seed)
    used_blocks = -(-context_len // BLOCK_SIZE)
    num_blocks = 2 * used_blocks
    kv_cache = torch.randn(2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[:used_blocks].tolist()
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(query_len, q_size + 2 * kv_size, generator=generator)
    q = qkv[:, :q_size].view(query_len, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(query_len, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(query_len, NUM_KV_HEADS, HEAD_DIM)
    args = ([table], [context_len], [query_len], BLOCK_SIZE, torch.float32, torch.device("cpu"))
    sdpa_meta = build_attention_metadata(TorchSDPABackend(), *args)
    kernel_meta = build_attention_metadata(native, *args)
    # Write this chunk's keys where the engine would have put them before attention runs.
    kv_cache[0].index_copy_(0, sdpa_meta.slot_mapping, k)
    kv_cache[1].index_copy_(0, sdpa_meta.slot_mapping, v)
    return Step(q, k, v, kv_cache, sdpa_meta, kernel_meta)


def attention_call(step: Step, meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
    span, scale = meta.prefills[0], HEAD_DIM**-0.5
    return lambda: meta.backend.prefill(step.q, step.k, step.v, step.kv_cache, span, meta, scale)


def time_interleaved(calls: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, Timing]:
    timings = {name: Timing([], []) for name in calls}
    names = list(calls)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            calls[name]()
            wall_end, cpu_end = time.perf_counter(), time.process_time()
            timings[name].wall_s.append(wall_end - wall_start)
            timings[name].cpu_s.append(cpu_end - cpu_start)
    return timings


@dataclass(slots=True)
class Case:
    """One shape's calls and everything measured on it so far, over all rounds."""

    query_len: int
    context_len: int
    calls: dict[str, Callable[[], torch.Tensor]]
    reps_per_round: int
    max_abs_diff: float
    timings: dict[str, Timing]
    wall_s: float = 0.0  # time spent in this case: its share of the machine's noise is measured over it
    own_cpu_s: float = 0.0
    machine_busy_s: float = 0.0


def prepare_case(query_len: int, context_len: int, native: CPUNativeBackend, reps: int, budget_s: float) -> Case:
    step = make_step(query_len, context_len, native, seed=query_len * 10_007 + context_len)
    calls = {"sdpa": attention_call(step, step.sdpa_meta), "kernel": attention_call(step, step.kernel_meta)}
    max_diff = (calls["sdpa"]() - calls["kernel"]()).abs().max().item()
    warm = time_interleaved(calls, 2)
    per_rep = sum(statistics.median(t.wall_s) for t in warm.values())
    reps_per_round = max(reps, min(50, int(budget_s / per_rep)))
    return Case(query_len, context_len, calls, reps_per_round, max_diff, {name: Timing([], []) for name in calls})


def run_round(case: Case) -> None:
    busy, own, wall = _machine_busy_s(), time.process_time(), time.perf_counter()
    for name, timing in time_interleaved(case.calls, case.reps_per_round).items():
        case.timings[name].wall_s.extend(timing.wall_s)
        case.timings[name].cpu_s.extend(timing.cpu_s)
    case.wall_s += time.perf_counter() - wall
    case.own_cpu_s += time.process_time() - own
    case.machine_busy_s += _machine_busy_s() - busy


def summarize(case: Case) -> dict:
    flops = 4 * case.query_len * case.context_len * NUM_HEADS * HEAD_DIM
    row: dict = {
        "query_len": case.query_len,
        "context_len": case.context_len,
        "cached_prefix": case.context_len > case.query_len,
        "reps": len(case.timings["sdpa"].wall_s),
        "max_abs_diff": case.max_abs_diff,
    }
    for name, timing in case.timings.items():
        wall = statistics.median(timing.wall_s)
        row[name] = {
            "wall_ms_median": wall * 1e3,
            "wall_ms_min": min(timing.wall_s) * 1e3,
            "cpu_ms_median": statistics.median(timing.cpu_s) * 1e3,
            "gflops": flops / wall / 1e9,
        }
    sdpa, kernel = case.timings["sdpa"], case.timings["kernel"]
    row["speedup_median_wall"] = row["sdpa"]["wall_ms_median"] / row["kernel"]["wall_ms_median"]
    row["speedup_median_paired"] = statistics.median(s / k for s, k in zip(sdpa.wall_s, kernel.wall_s))
    row["speedup_median_cpu"] = row["sdpa"]["cpu_ms_median"] / row["kernel"]["cpu_ms_median"]
    # CPU time other processes took while this case ran, as a share of the machine: the noise it ran in.
    others = max(0.0, case.machine_busy_s - case.own_cpu_s)
    row["other_processes_cpu_share"] = others / (case.wall_s * (os.cpu_count() or 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="sweeps over all cases, so each spans the run")
    parser.add_argument("--reps", type=int, default=7, help="least repetitions per case and round")
    parser.add_argument("--budget-s", type=float, default=1.0, help="rough time per case and round, both paths")
    parser.add_argument("--quick", action="store_true", help="only query_len 130 / context 2500")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/prefill_attention_micro.json", help="JSON result file"
    )
    args = parser.parse_args()
    import torch

    from kvyard.kernels.ops import load_native_kernels
    from kvyard.models.attention_backends import CPUNativeBackend

    try:
        native = CPUNativeBackend(load_native_kernels())
    except KernelsUnavailable as error:
        raise SystemExit(f"native kernels unavailable: {error}") from None
    shapes = [(130, 2500)] if args.quick else CACHED_CASES + WHOLE_PROMPT_CASES
    load_before = os.getloadavg()
    cases = [prepare_case(q, c, native, args.reps, args.budget_s) for q, c in shapes]
    for _ in range(args.rounds):
        for case in cases:
            run_round(case)
    rows = [summarize(case) for case in cases]
    print(
        f"{'query':>6} {'context':>8} {'SDPA ms':>8} {'kernel ms':>10} {'SDPA GF':>8} {'kernel GF':>10} "
        f"{'speedup':>8} {'paired':>7} {'others':>7}"
    )
    for row in rows:
        sdpa, kernel = row["sdpa"], row["kernel"]
        print(
            f"{row['query_len']:>6} {row['context_len']:>8} {sdpa['wall_ms_median']:>8.2f} "
            f"{kernel['wall_ms_median']:>10.2f} {sdpa['gflops']:>8.1f} {kernel['gflops']:>10.1f} "
            f"{row['speedup_median_wall']:>7.2f}x {row['speedup_median_paired']:>6.2f}x "
            f"{row['other_processes_cpu_share']:>6.0%}"
        )
    report = {
        "benchmark": "prefill_attention_micro",
        "conditions": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "float32",
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "kvyard_commit": _commit(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "timing": "paths interleaved per repetition (order alternating), every case once per round; "
            "medians over all rounds; GFLOPS = 4*query_len*context_len*heads*head_dim / median wall",
        },
        "cases": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def _machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot (all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return result.stdout.strip()


if __name__ == "__main__":
    main()

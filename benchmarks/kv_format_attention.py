"""Decode attention and KV store, one layer, with the paged KV cache in each format: fp32, fp16, bf16, int8.

Shapes of the `bench` preset (8 query heads, 4 KV heads, head_dim 64, block size 16) at batch 1, 16 and 64 and
contexts of 512 and 2,048 tokens, the blocks scattered through a pool as in a running engine. Each case times the
native decode kernel (one query per sequence against its whole context) and the store kernel (this step's keys
and values into the cache, converted to the format). The formats alternate within every repetition, in a new
order each time, so drift on a shared machine hits them alike; the report gives median times and, per case, each
format's median per-repetition ratio to fp32 (above 1: faster than fp32), with the bytes of KV each call reads.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_format_attention.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvyard.kernels.ops import NativeKernels

ROOT = Path(__file__).resolve().parent.parent
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
FORMATS = ("fp32", "fp16", "bf16", "int8")
CASES = [(batch, context) for batch in (1, 16, 64) for context in (512, 2048)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per case and format")
    # None: torch's own thread count, read in main() (torch takes 1 s to import: not before --help has had its chance)
    parser.add_argument("--threads", type=int, default=None, help="threads (None: torch's own count)")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "kv_format_attention.json",
        help="JSON result file",
    )
    return parser.parse_args()


@dataclass(frozen=True, slots=True)
class Case:
    caches: dict[str, torch.Tensor]  # the same values in each format
    tables: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor  # where this step's k, v go: each sequence's last slot


def make_case(batch: int, context: int) -> Case:
    import torch

    from kvyard.models.kv_format import KVFormat, to_storage

    generator = torch.Generator().manual_seed(batch * 10_000 + context)
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 8
    values = torch.randn(2, num_blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    return Case(
        caches={name: to_storage(values, KVFormat(name).storage_dtype) for name in FORMATS},
        tables=tables.contiguous(),
        lens=torch.full((batch,), context, dtype=torch.long),
        q=torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator),
        k=torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator),
        v=torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator),
        slots=tables[:, -1] * BLOCK_SIZE + BLOCK_SIZE - 1,
    )


def timed(call: Callable[[], object], repeats: int = 5) -> float:
    """Seconds per call: the minimum of `repeats` (to step over a brief preemption)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure(kernels: NativeKernels, case: Case, name: str) -> tuple[float, float]:
    """Seconds of one decode-attention call and of one store of the step's keys and values."""
    cache = case.caches[name]
    max_context = int(case.tables.shape[1]) * BLOCK_SIZE
    decode = timed(
        lambda: kernels.paged_decode(
            case.q, cache[0], cache[1], case.tables, case.lens, max_context, BLOCK_SIZE, HEAD_DIM**-0.5
        )
    )
    store = timed(lambda: kernels.store_kv(cache[0], cache[1], case.slots, case.k, case.v))
    return decode, store


def speedup(baseline: list[float], times: list[float]) -> float:
    """Median over repetitions of baseline time / time: above 1, faster than the baseline."""
    return round(statistics.median(b / t for b, t in zip(baseline, times)), 3)


def main() -> int:
    args = parse_args()
    import torch  # 1 s to import, as the kvyard modules below: not before --help has had its chance

    from kvyard.kernels.ops import load_native_kernels
    from kvyard.models.kv_format import KVFormat

    if args.threads is None:
        args.threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    kernels = load_native_kernels()
    results = []
    for batch, context in CASES:
        case = make_case(batch, context)
        times: dict[str, dict[str, list[float]]] = {name: {"decode": [], "store": []} for name in FORMATS}
        order = list(FORMATS)
        for _ in range(args.repeats):
            random.shuffle(order)
            for name in order:
                decode, store = measure(kernels, case, name)
                times[name]["decode"].append(decode)
                times[name]["store"].append(store)
        row: dict[str, object] = {"batch": batch, "context": context}
        for name in FORMATS:
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * KVFormat(name).row_bytes(HEAD_DIM)
            row[name] = {
                "decode_us": round(statistics.median(times[name]["decode"]) * 1e6, 1),
                "store_us": round(statistics.median(times[name]["store"]) * 1e6, 2),
                "kv_mb_read": round(kv_bytes / 1e6, 2),
                "decode_speedup_vs_fp32": speedup(times["fp32"]["decode"], times[name]["decode"]),
            }
        print(json.dumps(row), flush=True)
        results.append(row)
    conditions = {
        "shapes": f"{NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, block {BLOCK_SIZE}, one "
        "layer, blocks scattered",
        "threads": args.threads,
        "repeats": args.repeats,
        "cpu": platform.processor() or platform.machine(),
        "kvyard_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }
    args.out.write_text(json.dumps({"conditions": conditions, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

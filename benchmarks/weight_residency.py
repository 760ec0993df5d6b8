"""Is a decode step reading its weights from memory or from the CPU's cache, and does an int8 draft evict them?

Speculative decoding on CPU rests on one premise: a decode step is bound by reading every weight from memory, so
a verification of K + 1 rows costs little more than a step of one, and a draft that reads a quarter of the bytes
costs a quarter of a step. On a machine whose last-level cache holds most of a small model, neither holds. This
benchmark measures it with the decode path's own kernels on a preset's real shapes (every layer's four projections
and the head, fp32 weights; the int8 copy of them as `self-int8` drafts with):

- `hot`: the same fp32 weights pass after pass (as plain decoding reads them);
- `cold`: passes cycle over enough copies of the weights that none can stay in the last-level cache;
- `after_draft`: each fp32 pass follows `--draft-passes` int8 passes (as a verification follows its draft);

each for 1 row and for `--verify-rows` rows. Reported: median milliseconds per pass and the ratios between them.

    .venv/bin/python benchmarks/weight_residency.py --out benchmarks/results/weight_residency.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvyard.testing.model_presets import PRESETS

if TYPE_CHECKING:  # imported where used, so that --help answers at once
    import torch

    from kvyard.kernels.ops import NativeKernels
    from kvyard.testing.create_model import Preset

Weights = list["torch.Tensor"]
Int8Weights = list[tuple["torch.Tensor", "torch.Tensor"]]


def projection_shapes(preset: Preset) -> list[tuple[int, int]]:
    """[out, in] of every weight a decode step reads, layer by layer, then the head."""
    q_size, kv_size = preset.num_heads * preset.head_dim, preset.num_kv_heads * preset.head_dim
    layer = [
        (q_size + 2 * kv_size, preset.hidden_size),
        (preset.hidden_size, q_size),
        (2 * preset.intermediate_size, preset.hidden_size),
        (preset.hidden_size, preset.intermediate_size),
    ]
    return layer * preset.num_layers + [(preset.vocab_size, preset.hidden_size)]


def last_level_cache_bytes() -> int:
    """The largest cache the OS lists (0 when it lists none)."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        text = (index / "size").read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


def median_ms(run: Callable[[int], None], repeats: int) -> float:
    """Median wall time of run(i) over i in range(repeats), in milliseconds."""
    return statistics.median(_timed(run, i) for i in range(repeats)) * 1e3


def _timed(run: Callable[[int], None], i: int) -> float:
    start = time.perf_counter()
    run(i)
    return time.perf_counter() - start


@dataclass(slots=True)
class WeightPasses:
    """One decode step's matmuls over copies of a preset's weights, with the decode path's kernels."""

    kernels: NativeKernels
    copies: list[Weights]  # fp32, all the same shapes
    int8: Int8Weights  # the first copy in int8
    inputs: dict[tuple[int, int], torch.Tensor]  # (rows, in_features) -> x, made before any timing
    threads: int

    @classmethod
    def create(cls, shapes: list[tuple[int, int]], num_copies: int, row_counts: tuple[int, ...]) -> WeightPasses:
        import torch

        from kvyard.kernels.ops import load_native_kernels
        from kvyard.models.quantization import quantize_int8

        torch.manual_seed(0)
        copies = [[torch.randn(n, k) for n, k in shapes] for _ in range(num_copies)]
        inputs = {(rows, k): torch.ones(rows, k) for rows in row_counts for _, k in shapes}
        int8 = [quantize_int8(weight) for weight in copies[0]]
        return cls(load_native_kernels(), copies, int8, inputs, torch.get_num_threads())

    def fp32(self, copy: int, rows: int) -> None:
        for weight in self.copies[copy]:
            self.kernels.small_linear(self.inputs[rows, weight.shape[1]], weight, None)

    def int8_pass(self) -> None:
        for q, scales in self.int8:
            self.kernels.small_linear_int8(self.inputs[1, q.shape[1]], q, scales, None)

    def hot_ms(self, rows: int, repeats: int) -> float:
        return median_ms(lambda _: self.fp32(0, rows), repeats)

    def cold_ms(self, rows: int, repeats: int) -> float:
        return median_ms(lambda i: self.fp32(i % len(self.copies), rows), repeats)

    def after_draft_ms(self, rows: int, draft_passes: int, repeats: int) -> float:
        """Median time of a fp32 pass that follows `draft_passes` int8 passes (those untimed)."""
        times: list[float] = []
        for _ in range(repeats):
            for _ in range(draft_passes):
                self.int8_pass()
            times.append(_timed(lambda _: self.fp32(0, rows), 0))
        return statistics.median(times) * 1e3


def measure(passes: WeightPasses, verify_rows: int, draft_passes: int, repeats: int) -> dict[str, float]:
    results: dict[str, float] = {}
    for rows in (1, verify_rows):
        results[f"hot_{rows}_rows_ms"] = passes.hot_ms(rows, repeats)
        results[f"cold_{rows}_rows_ms"] = passes.cold_ms(rows, repeats)
        results[f"after_draft_{rows}_rows_ms"] = passes.after_draft_ms(rows, draft_passes, repeats)
        print({key: round(value, 3) for key, value in results.items()}, flush=True)
    results["int8_pass_hot_ms"] = median_ms(lambda _: passes.int8_pass(), repeats)
    return results


def ratios_of(results: dict[str, float], rows: int) -> dict[str, float]:
    hot = results["hot_1_rows_ms"]
    return {
        "cold_over_hot_1_row": results["cold_1_rows_ms"] / hot,
        "after_draft_over_hot_1_row": results["after_draft_1_rows_ms"] / hot,
        f"verify_{rows}_over_1_row_hot": results[f"hot_{rows}_rows_ms"] / hot,
        f"verify_{rows}_over_1_row_cold": results[f"cold_{rows}_rows_ms"] / results["cold_1_rows_ms"],
        f"verify_{rows}_after_draft_over_1_row_hot": results[f"after_draft_{rows}_rows_ms"] / hot,
        "int8_pass_over_fp32_pass_hot": results["int8_pass_hot_ms"] / hot,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", choices=PRESETS, default="bench", help="whose shapes the weights take")
    parser.add_argument("--verify-rows", type=int, default=5, help="rows of a verification (K + 1)")
    parser.add_argument("--draft-passes", type=int, default=4, help="int8 passes before each fp32 pass (K)")
    parser.add_argument("--repeats", type=int, default=40, help="timed passes per case (medians reported)")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/weight_residency.json"), help="JSON result file"
    )
    args = parser.parse_args()
    from kvyard.bench.provenance import command_line, git_state, host, utc_now
    from kvyard.testing.create_model import preset_spec

    shapes = projection_shapes(preset_spec(args.preset))
    weight_bytes = sum(n * k for n, k in shapes) * 4
    cache_bytes = last_level_cache_bytes()
    num_copies = max(2, -(-2 * cache_bytes // weight_bytes) + 1)
    print(
        f"{args.preset}: {weight_bytes / 1e6:.0f} MB of fp32 weights a step; last-level cache listed "
        f"{cache_bytes / 2**20:.0f} MiB; {num_copies} copies for cold passes",
        flush=True,
    )
    passes = WeightPasses.create(shapes, num_copies, (1, args.verify_rows))
    results = measure(passes, args.verify_rows, args.draft_passes, args.repeats)
    ratios = ratios_of(results, args.verify_rows)
    conditions = {
        "preset": args.preset,
        "threads": passes.threads,
        "fp32_weight_bytes_per_pass": weight_bytes,
        "int8_weight_bytes_per_pass": sum(q.numel() + s.numel() * 4 for q, s in passes.int8),
        "last_level_cache_bytes_listed": cache_bytes,
        "cold_copies": num_copies,
        "verify_rows": args.verify_rows,
        "draft_passes": args.draft_passes,
        "repeats": args.repeats,
    }
    report = {
        "benchmark": "weight_residency",
        "time": utc_now(),
        "command": command_line(),
        "kvyard": git_state(),
        "host": host(),
        "conditions": conditions,
        "median_ms": results,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for key, value in ratios.items():
        print(f"{key:>40}: {value:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

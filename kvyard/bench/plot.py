"""`--plot out.png`: TTFT and inter-token latency CDFs, and TTFT over the run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvyard.bench.metrics import inter_token_latencies
from kvyard.bench.records import RequestRecord


def plot_result(records: Sequence[RequestRecord], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok and r.ttft is not None]
    ttft_ms = [(r.ttft or 0.0) * 1000 for r in done]
    itl_ms = [gap * 1000 for r in done for gap in inter_token_latencies(r)]
    figure, (ttft_axis, itl_axis, time_axis) = plt.subplots(1, 3, figsize=(16, 4.5))
    _cdf(ttft_axis, ttft_ms, "TTFT (ms)")
    _cdf(itl_axis, itl_ms, "inter-token latency (ms)")
    time_axis.scatter([r.start for r in done], ttft_ms, s=6, alpha=0.6)
    failed = [r for r in records if not r.ok]
    if failed:
        time_axis.scatter(
            [r.start for r in failed],
            [0.0] * len(failed),
            s=12,
            marker="x",
            color="red",
            label=f"failed ({len(failed)})",
        )
        time_axis.legend()
    time_axis.set_xlabel("request start (s after the benchmark began)")
    time_axis.set_ylabel("TTFT (ms)")
    time_axis.set_title("TTFT over time")
    time_axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def _cdf(axis: object, values: Sequence[float], label: str) -> None:
    ordered = sorted(values)
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axis.step(ordered, fractions, where="post")  # type: ignore[attr-defined]
    axis.set_xlabel(label)  # type: ignore[attr-defined]
    axis.set_ylabel("fraction of samples")  # type: ignore[attr-defined]
    axis.set_title(f"{label.split(' (')[0]} CDF ({len(ordered)} samples)")  # type: ignore[attr-defined]
    axis.grid(alpha=0.3)  # type: ignore[attr-defined]

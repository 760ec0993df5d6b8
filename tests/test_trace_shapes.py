"""benchmarks/trace_shapes.py: generated traces have the shape they are named for, in the format routing.py reads."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import routing  # noqa: E402
import trace_shapes  # noqa: E402
from trace_shapes import SHAPES, Shape  # noqa: E402


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: shape.name)
def test_a_shape_has_its_lengths_reuse_and_outputs(shape: Shape) -> None:
    requests = trace_shapes.generate(shape, 1_000, seed=3)
    stats = trace_shapes.statistics(requests)
    assert abs(stats["unlimited_reuse"] - shape.reuse) <= 0.02 or stats["unlimited_reuse"] > shape.reuse
    assert 0.85 < stats["prompt_p50"] / shape.median_prompt < 1.2
    assert stats["prompt_max"] <= shape.max_prompt
    assert 0.8 < stats["mean_output"] / shape.mean_output < 1.2
    times = [request.timestamp_ms for request in requests]
    assert times == sorted(times) and trace_shapes.generate(shape, 1_000, seed=3) == requests  # repeatable


def test_a_continuing_turn_extends_its_conversation(tmp_path: Path) -> None:
    """Turns of one conversation share their prefix blocks and the routing benchmark's session key."""
    requests = trace_shapes.generate(SHAPES[0], 500, seed=1)
    by_first_own_block: dict[int, list[trace_shapes.Request]] = {}
    for request in requests:
        if len(request.hash_ids) > 1:
            by_first_own_block.setdefault(request.hash_ids[1], []).append(request)
    turns = [members for members in by_first_own_block.values() if len(members) > 1]
    assert turns
    for members in turns:
        for earlier, later in itertools.pairwise(members):
            assert later.hash_ids[: len(earlier.hash_ids)] == earlier.hash_ids
            assert later.input_length > earlier.input_length
    path = tmp_path / "shape.jsonl"
    trace_shapes.write(path, requests)
    loaded = routing.load_trace(path, 500, max_output=10_000)
    assert [r.hash_ids for r in loaded] == [r.hash_ids for r in requests]
    assert routing.ideal_hit_ratio(loaded) == pytest.approx(
        trace_shapes.statistics(requests)["unlimited_reuse"], abs=1e-4
    )


def test_bursty_arrivals_come_in_bursts() -> None:
    calm, bursty = (
        trace_shapes._arrivals(Shape("x", 1, 2, 3, 0.0, 1, 1.0, burst_factor=f), 4_000, trace_shapes.random.Random(0))
        for f in (1.0, 6.0)
    )

    def busiest_window_share(times: list[int]) -> float:
        windows: dict[int, int] = {}
        for time_ms in times:
            windows[time_ms // 10_000] = windows.get(time_ms // 10_000, 0) + 1
        return max(windows.values()) / len(times)

    assert busiest_window_share(bursty) > 2 * busiest_window_share(calm)

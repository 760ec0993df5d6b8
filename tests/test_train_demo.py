"""The demo model's training data and schedule (the training run itself is too long for the suite)."""

from __future__ import annotations

import random
from pathlib import Path

from kvyard.testing.train_demo import (
    HELD_OUT_PERCENT,
    TrainSettings,
    definitions,
    held_out,
    learning_rate,
    packed_rows,
    stdlib_sources,
)


def test_definitions_are_the_top_level_functions_and_classes(tmp_path: Path) -> None:
    path = tmp_path / "module.py"
    path.write_text(
        'import os\n\ndef add(a, b):\n    """Add two numbers.\n\n    More."""\n    return a + b\n\n'
        "class Box:\n    def open(self):\n        pass\n\nx = 1\n"
    )
    found = list(definitions(path))
    assert [source.splitlines()[0] for source, _ in found] == ["def add(a, b):", "class Box:"]
    assert [summary for _, summary in found] == ["Add two numbers.", None]
    (tmp_path / "broken.py").write_text("def (:\n")
    assert list(definitions(tmp_path / "broken.py")) == []


def test_the_held_out_split_is_fixed_and_about_a_tenth() -> None:
    paths = stdlib_sources()
    assert paths and not any("test" in path.parts for path in paths)
    fraction = sum(map(held_out, paths)) / len(paths)
    assert abs(fraction - HELD_OUT_PERCENT / 100) < 0.04
    assert [held_out(p) for p in paths[:50]] == [held_out(p) for p in stdlib_sources(50)]


def test_packing_keeps_every_token_of_whole_rows_in_a_seeded_order() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    rows = packed_rows(docs, 4, random.Random(0))
    assert rows.shape == (2, 4)
    assert rows.tolist() == packed_rows(docs, 4, random.Random(0)).tolist()
    assert set(rows.flatten().tolist()) <= set(range(1, 11))


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    settings = TrainSettings(learning_rate=1e-3, warmup_steps=10)
    assert learning_rate(settings, 0, 0.0) == 1e-4
    assert learning_rate(settings, 10, 0.0) == 1e-3
    assert abs(learning_rate(settings, 500, 1.0) - 1e-4) < 1e-12

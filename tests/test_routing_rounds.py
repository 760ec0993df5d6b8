"""benchmarks/routing_rounds.py: rounds run one at a time combine only when their conditions and numbers hold."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import routing_rounds  # noqa: E402
from routing_rounds import RunError  # noqa: E402

CONDITIONS = {"requests": 4, "time_scale": 0.03, "shared_store_blocks": 100, "unlimited_cache_hit_ratio": 0.5}


def lines_for(ttfts: list[float], cached: int) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "ok": True,
            "sent_s": float(i),
            "ttft_s": ttft,
            "floor_s": 0.1,
            "prompt_tokens": 100,
            "cached_tokens": cached,
            "cached_by_source": {"device": cached, "local": 0, "shared": 0},
            "replica": "",
        }
        for i, ttft in enumerate(ttfts)
    ]


def write_run(directory: Path, name: str, router: str, lines: list[dict[str, Any]], **overrides: Any) -> Path:
    """A one-round report as routing.py writes it, its reported numbers taken from `lines` unless overridden."""
    metrics, _ = routing_rounds.recompute(lines)
    run = {"router": router, "round": 1, "sim_lag_s_max": 1.5, **metrics, **overrides.pop("run", {})}
    report = {"conditions": {**CONDITIONS, "rounds": 1, **overrides}, "summary": [], "routing": [run]}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(report))
    with gzip.open(directory / f"{name}.requests.jsonl.gz", "wt") as out:
        out.writelines(json.dumps(line) + "\n" for line in lines)
    return path


def test_rounds_combine_into_spread_and_ratios(tmp_path: Path) -> None:
    paths = [
        write_run(tmp_path, "mine1", "kvyard cache_aware", lines_for([0.2, 0.3, 4.0, 5.0], 50)),
        write_run(tmp_path, "mine2", "kvyard cache_aware", lines_for([0.2, 0.3, 4.0, 7.0], 40)),
        write_run(tmp_path, "peer1", "smg cache_aware", lines_for([0.5, 0.6, 9.0, 12.0], 30)),
        write_run(tmp_path, "peer2", "vllm-router cache_aware", lines_for([0.4, 0.7, 8.0, 20.0], 30)),
    ]
    loaded = [routing_rounds.load_round(path) for path in paths]
    summary = routing_rounds.summarize([one for _, one in loaded])
    mine = summary["kvyard cache_aware"]
    assert mine["rounds"] == 2
    assert mine["ttft_p99_s"] == {"mean": 6.0, "min": 5.0, "max": 7.0}
    assert mine["hit_ratio"]["mean"] == pytest.approx(0.45)
    bars = routing_rounds.bars(summary, "kvyard cache_aware", 0.5)
    assert bars["best_peer_by_p99"] == "smg cache_aware"
    assert bars["ttft_p99_over_best_peer"] == pytest.approx(0.5)
    assert bars["hit_ratio_over_unlimited"] == pytest.approx(0.9)
    assert bars["ttft_p50_lowest"] is True  # 4.0 against 9.0 and 8.0


def test_round_whose_report_disagrees_with_its_lines_is_refused(tmp_path: Path) -> None:
    path = write_run(tmp_path, "bad", "smg cache_aware", lines_for([0.5, 0.6, 9.0, 12.0], 30), run={"ttft_p99_s": 9.0})
    with pytest.raises(RunError, match=r"ttft_p99_s reported 9\.0 but its per-request lines give 12\.0"):
        routing_rounds.load_round(path)


def test_rounds_under_different_conditions_are_refused(tmp_path: Path) -> None:
    first = write_run(tmp_path, "a", "smg cache_aware", lines_for([0.5, 0.6, 9.0, 12.0], 30))
    second = write_run(tmp_path, "b", "smg cache_aware", lines_for([0.5, 0.6, 9.0, 12.0], 30), time_scale=0.05)
    loaded = [routing_rounds.load_round(path) for path in (first, second)]
    with pytest.raises(RunError, match=r"condition 'time_scale' is 0\.05"):
        routing_rounds.common_conditions(loaded)


def test_report_without_lines_or_with_several_rounds_is_refused(tmp_path: Path) -> None:
    path = write_run(tmp_path, "gone", "smg cache_aware", lines_for([0.5, 0.6, 9.0, 12.0], 30))
    (tmp_path / "gone.requests.jsonl.gz").unlink()
    with pytest.raises(RunError, match="no per-request lines"):
        routing_rounds.load_round(path)
    report = json.loads(path.read_text())
    report["routing"] *= 2
    path.write_text(json.dumps(report))
    with pytest.raises(RunError, match="holds 2 completed rounds"):
        routing_rounds.load_round(path)


def test_cli_names_the_reason_and_exits_2(tmp_path: Path) -> None:
    path = write_run(tmp_path, "peer", "smg cache_aware", lines_for([0.5, 0.6, 9.0, 12.0], 30))
    command = [sys.executable, str(BENCHMARKS / "routing_rounds.py"), str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "no run of the subject router 'kvyard cache_aware'" in result.stderr


def test_committed_whole_trace_rounds_match_their_per_request_lines() -> None:
    reports = sorted((BENCHMARKS / "results").glob("routing_tiered_full_trace_peak08_loadext*.json"))
    loaded = [routing_rounds.load_round(path) for path in reports]  # raises if a report and its lines disagree
    routing_rounds.common_conditions(loaded)
    routers = {one.router for _, one in loaded}
    assert {"kvyard cache_aware", "sglang-router cache_aware", "smg cache_aware", "vllm-router cache_aware"} <= routers


def test_routing_conditions_carry_the_run_provenance(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(BENCHMARKS / "routing.py"),
        "--requests",
        "20",
        "--dry-run",
        "--out",
        str(tmp_path / "routing.json"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    provenance = json.loads(result.stdout.splitlines()[0])["provenance"]
    assert "--requests 20 --dry-run" in provenance["command"]
    assert len(provenance["git"]["commit"]) == 40 and provenance["host"]["cpu_count"] >= 1
    assert provenance["start_time"].startswith("20")

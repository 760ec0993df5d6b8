"""`kvyard bench` against live servers: every workload type against a real `kvyard serve`, with the result
checked against what the server's own /metrics counted; a server without kvyard's extras; compare and plots."""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import ServerProcess, free_port, metric_value, start_server

from kvyard.bench.traces import resolve_trace
from kvyard.cli import main as kvyard_main
from kvyard.cli.bench import run_cli

ROOT = Path(__file__).resolve().parent.parent
PROBE = {"requests": 1, "prompt_tokens": 4, "generation_tokens": 2, "cached_prompt_tokens": 0}  # the probe request
COUNTERS = {
    "requests": "kvyard_requests_total",
    "prompt_tokens": "kvyard_prompt_tokens_total",
    "generation_tokens": "kvyard_generation_tokens_total",
    "cached_prompt_tokens": "kvyard_cached_prompt_tokens_total",
}


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(llama_dir, tmp_path_factory.mktemp("bench-logs"), "--max-num-seqs", "32")
    yield process
    process.stop()


def counters(url: str) -> dict[str, float]:
    """The server's counters, read by the test itself (summed over labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for quantity, name in COUNTERS.items():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                totals[quantity] += float(line.rsplit(" ", 1)[1])
    return totals


def bench(url: str, out: Path, *args: str) -> dict[str, Any]:
    assert run_cli(["--base-url", url, "--out", str(out), "--no-progress", *args]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def check_against_server(result: dict[str, Any], before: dict[str, float], after: dict[str, float]) -> None:
    """What the client reports equals what the server counted (less the one probe request before the run)."""
    summary = result["summary"]
    done = [r for r in result["requests"] if r["error"] is None]
    assert summary["requests"]["failed"] == 0, summary["errors"]
    client = {
        "requests": len(done),
        "prompt_tokens": summary["tokens"]["prompt"],
        "generation_tokens": summary["tokens"]["output"],
        "cached_prompt_tokens": summary["prefix_cache"]["cached_tokens"],
    }
    measured_by_test = {k: after[k] - before[k] - PROBE[k] for k in COUNTERS}
    assert client == pytest.approx(measured_by_test)
    counted = {k: v for k, v in result["server"]["counted"].items() if k in client}
    assert counted == pytest.approx(client)  # the JSON's own before/after snapshots agree
    assert summary["tokens"]["prompt"] == sum(r["prompt_tokens"] for r in done)  # the server saw what was sent
    assert all(r["output_tokens"] == r["max_tokens"] for r in done)  # ignore_eos made lengths exact
    assert result["server"]["missing"] == []


def test_random_workload_matches_server_counts(server: ServerProcess, tmp_path: Path) -> None:
    before = counters(server.url)
    result = bench(
        server.url,
        tmp_path / "r.json",
        "--workload",
        "random",
        "--num-requests",
        "12",
        "--concurrency",
        "4",
        "--input-len",
        "20:60",
        "--output-len",
        "2:5",
        "--slo",
        "ttft=60s",
        "--seed",
        "7",
    )
    check_against_server(result, before, counters(server.url))
    s = result["summary"]
    assert s["requests"]["completed"] == 12
    assert s["ttft_s"]["p50"] > 0 and s["e2e_s"]["p99"] >= s["ttft_s"]["p99"]
    assert s["goodput"]["good_requests"] == 12
    assert result["workload"]["params"]["input_len"] == "20:60" and result["workload"]["seed"] == 7
    assert result["arrivals"]["mode"] == "closed" and result["arrivals"]["concurrency"] == 4
    provenance = result["provenance"]
    assert "--workload random" in provenance["command"] and len(provenance["git"]["commit"]) == 40
    assert provenance["host"]["cpu_count"] >= 1 and provenance["start_time"] <= provenance["end_time"]
    assert result["server"]["models"]["data"][0]["id"] == result["server"]["model"]
    assert result["server"]["metrics_before"] and result["server"]["metrics_after"]
    assert result["server"]["load_before"] is not None


def test_shared_prefix_hits_the_ideal(server: ServerProcess, tmp_path: Path) -> None:
    before = counters(server.url)
    result = bench(
        server.url,
        tmp_path / "s.json",
        "--workload",
        "shared-prefix",
        "--num-requests",
        "9",
        "--num-groups",
        "3",
        "--prefix-len",
        "64",
        "--input-len",
        "16",
        "--output-len",
        "2",
        "--concurrency",
        "1",
        "--seed",
        "11",
    )
    check_against_server(result, before, counters(server.url))
    cache = result["summary"]["prefix_cache"]
    # One at a time, later members of a group find the group's 64-token prefix cached (4 blocks of 16).
    assert cache["cached_tokens"] == 6 * 64 == cache["ideal_cached_tokens"]
    assert cache["hit_ratio"] == pytest.approx(cache["ideal_hit_ratio"])


def test_multiturn_with_think_time_and_rewrites(server: ServerProcess, tmp_path: Path) -> None:
    before = counters(server.url)
    result = bench(
        server.url,
        tmp_path / "m.json",
        "--workload",
        "multiturn",
        "--num-sessions",
        "3",
        "--turns",
        "4",
        "--system-len",
        "48",
        "--first-len",
        "32",
        "--turn-len",
        "8:24",
        "--output-len",
        "3",
        "--think-time",
        "0.02",
        "--rewrite-prob",
        "0.5",
        "--concurrency",
        "3",
        "--seed",
        "2",
    )
    check_against_server(result, before, counters(server.url))
    records = result["requests"]
    assert len(records) == 12
    assert result["workload"]["info"]["rewrites"] > 0
    by_session: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    for turns in by_session.values():
        assert [r["turn"] for r in turns] == [0, 1, 2, 3]
        assert all(later["start"] >= earlier["end"] for earlier, later in itertools.pairwise(turns))
    assert result["summary"]["prefix_cache"]["cached_tokens"] > 0


def test_mooncake_first_200_requests_report_hit_ratio_next_to_ideal(server: ServerProcess, tmp_path: Path) -> None:
    assert resolve_trace("mooncake").is_file()  # shipped with kvyard
    before = counters(server.url)
    # 512-token blocks become 16 tokens (the server's block size); 72 s of arrivals replay in 1.4 s.
    result = bench(
        server.url,
        tmp_path / "t.json",
        "--workload",
        "trace",
        "--trace",
        "mooncake",
        "--num-requests",
        "200",
        "--length-scale",
        "0.03125",
        "--max-input-len",
        "512",
        "--output-scale",
        "0.01",
        "--max-output-len",
        "2",
        "--time-scale",
        "0.02",
    )
    check_against_server(result, before, counters(server.url))
    s, info = result["summary"], result["workload"]["info"]
    assert s["requests"]["completed"] == 200
    assert result["arrivals"]["mode"] == "trace"
    assert 0 < info["trace_ideal_block_hit_ratio"] < 1
    assert info["trace_ideal_block_hit_ratio_unscaled"] == pytest.approx(0.0582, abs=1e-3)
    cache = s["prefix_cache"]
    assert 0 < cache["hit_ratio"] <= cache["ideal_hit_ratio"] + 1e-9
    assert all(r["scheduled"] is not None for r in result["requests"])


def test_azure_trace_replays_without_prefix_information(server: ServerProcess, tmp_path: Path) -> None:
    trace = resolve_trace("azure")  # shipped with kvyard, given as a path (gzip-compressed)
    before = counters(server.url)
    result = bench(
        server.url,
        tmp_path / "a.json",
        "--workload",
        "trace",
        "--trace",
        str(trace),
        "--num-requests",
        "15",
        "--length-scale",
        "0.02",
        "--output-scale",
        "0.1",
        "--max-output-len",
        "3",
        "--time-scale",
        "0.5",
        "--request-rate",
        "50",
        "--seed",
        "3",
    )
    check_against_server(result, before, counters(server.url))
    assert result["arrivals"]["mode"] == "poisson"  # --request-rate overrides the trace's timestamps
    assert "trace_ideal_block_hit_ratio" not in result["workload"]["info"]


def test_compare_and_plot(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--workload", "random", "--num-requests", "6", "--input-len", "32", "--output-len", "4"]
    bench(server.url, tmp_path / "one.json", *common, "--concurrency", "1", "--plot", str(tmp_path / "one.png"))
    bench(server.url, tmp_path / "six.json", *common, "--concurrency", "6")
    png = (tmp_path / "one.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    capsys.readouterr()
    assert kvyard_main(["bench", "compare", str(tmp_path / "one.json"), str(tmp_path / "six.json")]) == 0
    table = capsys.readouterr().out
    assert "x six" in table and "TTFT p50 (ms)" in table and "conditions:" in table
    ratio_row = next(line for line in table.splitlines() if line.startswith("completed requests"))
    assert ratio_row.split()[-1] == "1.000x"


def test_progress_shows_a_long_request_streaming_before_it_ends(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One request of 2,000 tokens: the bar says it streams, and how far it got, while it is the only request."""
    code = run_cli(
        [
            "--base-url",
            server.url,
            "--out",
            str(tmp_path / "long.json"),
            "--workload",
            "random",
            "--num-requests",
            "1",
            "--input-len",
            "16",
            "--output-len",
            "2000",
        ]
    )
    assert code == 0
    shown = capsys.readouterr().err
    under_way = re.findall(r"0/1 .*?in flight 1, streaming 1, (\d+) chunks out", shown)
    assert under_way and max(int(chunks) for chunks in under_way) > 0, shown[-2000:]


def test_a_speculating_server_reports_its_acceptance(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    process = start_server(llama_dir, tmp_path, "--speculative", "self-int8")
    try:
        before = httpx.get(f"{process.url}/metrics", timeout=10).text
        capsys.readouterr()
        result = bench(
            process.url,
            tmp_path / "spec.json",
            "--workload",
            "random",
            "--num-requests",
            "4",
            "--input-len",
            "24",
            "--output-len",
            "24",
            "--seed",
            "3",
        )
        printed = capsys.readouterr().out
        after = httpx.get(f"{process.url}/metrics", timeout=10).text
    finally:
        process.stop()

    counted = result["server"]["counted"]
    for quantity in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications"):
        name = f"kvyard_{quantity}_total"
        # the probe request (2 tokens) proposes nothing: its single decode step comes before any verification
        assert counted[quantity] == metric_value(after, name) - metric_value(before, name)
    assert 0 < counted["spec_accepted_tokens"] <= counted["spec_proposed_tokens"]
    summary = f"{counted['spec_accepted_tokens']:.0f} of {counted['spec_proposed_tokens']:.0f} proposed tokens accepted"
    assert summary in printed


@pytest.mark.parametrize("strict", [False, True])
def test_server_without_kvyard_extras(tmp_path: Path, strict: bool) -> None:
    """The trivial streaming server has no /metrics or /load (and, strict, refuses ignore_eos): the run still
    completes and the result says what was missing."""
    import subprocess

    port = free_port()
    script = ROOT / "benchmarks" / "trivial_stream_server.py"
    process = subprocess.Popen([sys.executable, str(script), "--port", str(port), *(["--strict"] if strict else [])])
    try:
        _wait_ready(f"http://127.0.0.1:{port}")
        result = bench(
            f"http://127.0.0.1:{port}",
            tmp_path / "plain.json",
            "--num-requests",
            "20",
            "--concurrency",
            "5",
            "--input-len",
            "8",
            "--output-len",
            "3",
        )
    finally:
        process.terminate()
        process.wait()
    assert result["summary"]["requests"]["completed"] == 20
    assert {"/metrics", "/load"} <= set(result["server"]["missing"])
    assert ("ignore_eos" in result["server"]["missing"]) == strict
    assert result["request"]["ignore_eos"] is not strict
    assert result["server"]["metrics_before"] is None and result["server"]["counted"] == {}
    assert result["summary"]["tokens"]["output"] == 60


def _wait_ready(url: str) -> None:
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


# ---------------------------------------------------------------------------- bad input


def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--base-url", "http://127.0.0.1:1", "--concurrency", "0"]) == 2
    assert "--concurrency must be at least 1" in capsys.readouterr().err
    assert run_cli(["--workload", "random"]) == 2
    assert "--base-url is required" in capsys.readouterr().err
    assert run_cli(["--base-url", "http://127.0.0.1:1", "--rewrite-prob", "2"]) == 2
    assert "--rewrite-prob" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli(["--base-url", "http://127.0.0.1:1", "--slo", "ttft=soon"])
    assert "needs a duration" in capsys.readouterr().err
    assert run_cli(["compare"]) == 2


def test_unreachable_server_and_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert run_cli(["--base-url", url, "--no-progress"]) == 1
    assert "cannot connect" in capsys.readouterr().err
    assert run_cli(["compare", str(tmp_path / "nope.json"), str(tmp_path / "nope2.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_bad_requests_are_counted_as_errors_and_fail_the_run(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Token ids beyond the tiny model's vocabulary: every request gets the server's 400, recorded by type, and
    the run exits 1 with the server's reason on screen."""
    out = tmp_path / "bad.json"
    code = run_cli(
        [
            "--base-url",
            server.url,
            "--out",
            str(out),
            "--no-progress",
            "--num-requests",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--vocab-size",
            "100000",
            "--seed",
            "1",
        ]
    )
    assert code == 1
    error = capsys.readouterr().err
    assert "3 of 3 requests failed" in error and "3 x http_400" in error and "outside the vocabulary" in error
    result = json.loads(out.read_text())
    assert result["summary"]["errors"] == {"http_400": 3}
    assert "outside the vocabulary" in result["requests"][0]["error_message"]

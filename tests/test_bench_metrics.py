"""Metric arithmetic of `kvyard bench` on hand-made timings, its workloads' token and trace semantics, and its
reading of a server's counters (a simulated replica's /metrics, and hand-made snapshots of other servers)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvyard.bench.metrics import (
    SLO,
    distribution,
    inter_token_latencies,
    parse_slo,
    percentile,
    summarize,
    tpot,
)
from kvyard.bench.prefix import PrefixTracker, ideal_block_hit_ratio
from kvyard.bench.probe import counted_by_server, metrics_snapshot
from kvyard.bench.records import RequestRecord
from kvyard.bench.report import compare_table, summary_table
from kvyard.bench.traces import TraceRequest, load_azure, load_mooncake
from kvyard.bench.workloads import (
    LengthRange,
    MultiturnSession,
    MultiturnShape,
    TokenSource,
    TraceScaling,
    random_workload,
    shared_prefix_workload,
    trace_workload,
)
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.net.http_client import HttpClient
from kvyard.sim.config import SimConfig
from kvyard.testing.sim_cluster import SimCluster, sim_server_options


def record(start: float, token_times: list[float], end: float, output: int, **fields: object) -> RequestRecord:
    r = RequestRecord(
        index=0,
        session=0,
        turn=0,
        prompt_tokens=100,
        max_tokens=output,
        start=start,
        end=end,
        token_times=token_times,
        output_tokens=output,
    )
    for name, value in fields.items():
        setattr(r, name, value)
    return r


# ---------------------------------------------------------------------------- percentiles


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 10.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * 6)  # rank 3.6 between 4 and 10
    assert percentile([7.0], 99) == 7.0


def test_percentiles_match_numpy_on_random_samples() -> None:
    rng = random.Random(5)
    for size in (2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for q in (1, 25, 50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_distribution_of_nothing_is_none() -> None:
    assert distribution([]) is None
    summary = distribution([1.0, 2.0, 3.0])
    assert summary is not None and summary["mean"] == 2.0 and summary["count"] == 3 and summary["p50"] == 2.0


# ---------------------------------------------------------------------------- per-request latencies


def test_tpot_excludes_the_first_token() -> None:
    # TTFT 0.5 s, then 4 more tokens 0.1 s apart: TPOT is 0.1 s whatever the TTFT was.
    r = record(1.0, [1.5, 1.6, 1.7, 1.8, 1.9], 2.0, 5)
    assert r.ttft == pytest.approx(0.5)
    assert tpot(r) == pytest.approx(0.1)
    assert r.e2e == pytest.approx(1.0)
    assert inter_token_latencies(r) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_tpot_counts_tokens_not_chunks() -> None:
    # Two chunks carried 9 tokens (usage says so): 0.8 s over the 8 tokens after the first.
    r = record(0.0, [0.2, 1.0], 1.0, 9)
    assert tpot(r) == pytest.approx(0.1)


def test_one_token_answer_has_no_tpot() -> None:
    assert tpot(record(0.0, [0.3], 0.3, 1)) is None


# ---------------------------------------------------------------------------- aggregates


def test_summary_throughput_errors_and_cache() -> None:
    records = [
        record(0.0, [0.1, 0.2, 0.3], 0.4, 3, cached_tokens=50, server_prompt_tokens=100, ideal_cached_tokens=64),
        record(1.0, [1.2, 1.3, 1.4], 2.0, 3, cached_tokens=0, server_prompt_tokens=100, ideal_cached_tokens=0),
        record(0.5, [], 0.6, 0, error="http_429"),
        record(0.7, [], 0.9, 0, error="http_429"),
        record(0.8, [], 1.0, 0, error="timeout"),
    ]
    s = summarize(records)
    assert s["requests"] == {"total": 5, "completed": 2, "failed": 3}
    assert s["errors"] == {"http_429": 2, "timeout": 1}
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["tokens"] == {"prompt": 200, "output": 6}
    assert s["throughput"]["requests_per_s"] == pytest.approx(1.0)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(3.0)
    assert s["throughput"]["total_tokens_per_s"] == pytest.approx(103.0)
    assert s["ttft_s"]["mean"] == pytest.approx(0.15)
    assert s["prefix_cache"]["hit_ratio"] == pytest.approx(0.25)
    assert s["prefix_cache"]["ideal_hit_ratio"] == pytest.approx(0.32)
    assert s["goodput"] is None


def test_cache_ratio_is_none_when_the_server_reports_nothing() -> None:
    s = summarize([record(0.0, [0.1], 0.2, 1)])
    assert s["prefix_cache"]["hit_ratio"] is None and s["prefix_cache"]["cached_tokens"] is None


def test_goodput_counts_requests_meeting_every_objective() -> None:
    records = [
        record(0.0, [0.1, 0.2, 0.3], 0.3, 3),  # TTFT 100 ms, TPOT 100 ms: good
        record(0.0, [0.6, 0.7], 0.7, 2),  # TTFT 600 ms: too slow to start
        record(0.0, [0.1, 0.5], 0.5, 2),  # TPOT 400 ms: too slow to stream
        record(0.0, [0.1], 0.1, 1),  # one token: no TPOT, TTFT fine: good
        record(0.0, [], 1.0, 0, error="http_500"),  # failed: never good
    ]
    slo = parse_slo("ttft=500ms,tpot=0.15s")
    assert slo == SLO(ttft=0.5, tpot=0.15)
    good = summarize(records, slo)["goodput"]
    assert good["good_requests"] == 2
    assert good["fraction"] == pytest.approx(0.4)
    assert good["requests_per_s"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [("ttft", "expected ttft"), ("latency=5", "expected ttft"), ("ttft=fast", "needs a duration"), ("", "at least")],
)
def test_bad_slo_is_rejected_with_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def test_bare_slo_numbers_are_milliseconds() -> None:
    assert parse_slo("ttft=250, e2e=2s") == SLO(ttft=0.25, e2e=2.0)


# ---------------------------------------------------------------------------- what the server counted


def snapshot(url: str) -> dict[str, float]:
    async def read() -> dict[str, float] | None:
        http = HttpClient(url)
        try:
            return await metrics_snapshot(http)
        finally:
            http.close()

    samples = asyncio.run(read())
    assert samples is not None
    return samples


def test_counts_are_read_off_a_replica_whose_metrics_name_its_model() -> None:
    """A simulated replica on loopback, one request at a time: a request it turns away (429) is not counted, the
    ones it served are, each counter summed over its labels, the model's name among them."""
    config = SimConfig(
        model_name="bench-model",
        block_size=4,
        num_kv_blocks=256,
        time_scale=1.0,
        scheduler=SchedulerConfig(max_num_seqs=1),
    )
    with SimCluster([config], sim_server_options(max_queued_seqs=0)) as sim:
        url = sim.urls[0]
        before = snapshot(url)
        body = {"prompt": list(range(10, 30)), "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as running:
            lines = running.iter_lines()
            next(lines)  # about a second of tokens to go: the replica is full until then
            turned_away = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30)
            assert turned_away.status_code == 429
            assert [line for line in lines if line][-1] == "data: [DONE]"
        served = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(40, 52)), "max_tokens": 3}, timeout=30)
        assert served.status_code == 200
        after = snapshot(url)
    rejected = "kvyard_requests_total{model_name=bench-model,outcome=rejected_overload}"
    assert after[rejected] - before.get(rejected, 0.0) == 1
    assert all("model_name=bench-model" in key for key in after if key.startswith("kvyard_"))
    counted = counted_by_server(before, after)
    assert {k: counted[k] for k in ("requests", "prompt_tokens", "generation_tokens", "cached_prompt_tokens")} == {
        "requests": 2,
        "prompt_tokens": 20 + 12,
        "generation_tokens": 40 + 3,
        "cached_prompt_tokens": 0,
    }


def test_counts_are_read_alike_without_the_model_label_and_summed_over_models() -> None:
    """A kvyard replica older than the label, then a server naming two models: totals over every model, less the
    requests turned away."""
    before = {
        "kvyard_requests_total{outcome=length}": 4.0,
        "kvyard_requests_total{outcome=rejected_overload}": 1.0,
        "kvyard_prompt_tokens_total": 40.0,
    }
    after = {
        "kvyard_requests_total{outcome=length}": 6.0,
        "kvyard_requests_total{outcome=rejected_overload}": 9.0,
        "kvyard_prompt_tokens_total": 70.0,
    }
    assert counted_by_server(before, after) == {"requests": 2, "prompt_tokens": 30}
    before = {"kvyard_requests_total{model_name=a,outcome=stop}": 1.0, "kvyard_prompt_tokens_total{model_name=a}": 10.0}
    after = {
        "kvyard_requests_total{model_name=a,outcome=stop}": 3.0,
        "kvyard_requests_total{model_name=b,outcome=length}": 4.0,
        "kvyard_requests_total{model_name=b,outcome=rejected_overload}": 2.0,
        "kvyard_prompt_tokens_total{model_name=a}": 30.0,
        "kvyard_prompt_tokens_total{model_name=b}": 50.0,
    }
    assert counted_by_server(before, after) == {"requests": 2 + 4, "prompt_tokens": 20 + 50}


# ---------------------------------------------------------------------------- ideal prefix reuse


def test_prefix_tracker_counts_leading_known_blocks_only() -> None:
    tracker = PrefixTracker(block_size=4)
    first = list(range(10))  # blocks [0..3], [4..7], and a partial block
    assert tracker.observe(first) == 0
    assert tracker.observe(first) == 8  # the two full blocks
    changed_middle = [*first[:4], 99, *first[5:]]
    assert tracker.observe(changed_middle) == 4  # the cached prefix ends at the change
    assert tracker.observe(changed_middle) == 8


def test_ideal_block_ratio_of_hash_ids() -> None:
    assert ideal_block_hit_ratio([[0, 1, 2], [0, 1, 3], [0, 4], [5]]) == pytest.approx(3 / 9)
    assert ideal_block_hit_ratio([]) is None


# ---------------------------------------------------------------------------- workloads


def test_tokens_are_deterministic_in_range_and_prefix_stable() -> None:
    source = TokenSource(vocab_size=50, seed=3)
    long, short = source.tokens((1, 2), 600), source.tokens((1, 2), 40)
    assert short == long[:40]  # a cut block is a prefix of the whole block (both code paths)
    assert source.tokens((1, 2), 600) == long
    assert source.tokens((1, 3), 40) != short
    assert TokenSource(50, 4).tokens((1, 2), 40) != short
    assert all(0 <= t < 50 for t in long)
    assert len(set(long)) == 50


def test_random_workload_lengths() -> None:
    workload = random_workload(20, LengthRange.parse("8:12"), LengthRange.parse("3"), TokenSource(100, 0))
    specs = [s.next_request(None) for s in workload.sessions]
    assert all(s is not None and 8 <= len(s.prompt) <= 12 and s.max_tokens == 3 for s in specs)
    assert all(s.next_request(None) is None for s in workload.sessions)  # one request per session


def test_shared_prefix_groups_share_exactly_their_prefix() -> None:
    workload = shared_prefix_workload(6, 2, 32, LengthRange(8, 8), LengthRange(1, 1), TokenSource(1000, 0))
    prompts = [s.next_request(None).prompt for s in workload.sessions]  # type: ignore[union-attr]
    assert prompts[0][:32] == prompts[2][:32] == prompts[4][:32] != prompts[1][:32]
    assert prompts[0][32:] != prompts[2][32:]


def test_multiturn_resends_history_and_rewrites_the_middle() -> None:
    lengths = {"first_len": LengthRange(10, 10), "turn_len": LengthRange(5, 5), "output_len": LengthRange(3, 3)}
    shape = MultiturnShape(1, 4, system_len=20, **lengths, think_time=0.0, rewrite_prob=0.0, max_context=None)
    session = MultiturnSession(0, shape, TokenSource(1000, 0), random.Random(0))
    first = session.next_request(None)
    assert first is not None and len(first.prompt) == 30
    answered = record(0.0, [0.1], 0.2, 3)
    second = session.next_request(answered)
    assert second is not None and second.prompt[:30] == first.prompt and len(second.prompt) == 30 + 3 + 5
    session.shape = MultiturnShape(**{**_fields(shape), "rewrite_prob": 1.0})
    third = session.next_request(answered)
    assert third is not None and session.rewrites == 1
    body = len(second.prompt) + 3 - 20
    begin = 20 + body // 3
    assert third.prompt[:begin] == second.prompt[:begin]  # the prefix up to the rewrite survives
    assert third.prompt[begin : begin + 5] != second.prompt[begin : begin + 5]
    middle = (20 + 2 * body // 3) - begin
    assert len(third.prompt) == len(second.prompt) + 3 - middle + middle // 2 + 5  # the middle shrank by half


def test_multiturn_compacts_to_fit_the_context() -> None:
    shape = MultiturnShape(
        1,
        50,
        system_len=10,
        first_len=LengthRange(20, 20),
        turn_len=LengthRange(20, 20),
        output_len=LengthRange(5, 5),
        think_time=0.0,
        rewrite_prob=0.0,
        max_context=120,
    )
    session = MultiturnSession(0, shape, TokenSource(1000, 0), random.Random(0))
    previous = None
    for _ in range(50):
        spec = session.next_request(previous)
        assert spec is not None and len(spec.prompt) + spec.max_tokens <= 120
        previous = record(0.0, [0.1], 0.1, 5)
    assert session.rewrites > 0


def _fields(shape: MultiturnShape) -> dict[str, object]:
    return {name: getattr(shape, name) for name in shape.__dataclass_fields__}


def test_trace_hash_ids_become_shared_blocks(tmp_path: Path) -> None:
    trace = [
        TraceRequest(0.0, 1000, 10, (0, 1)),
        TraceRequest(2.0, 1500, 20, (0, 1, 2)),
        TraceRequest(4.0, 700, 30, (0, 3)),
    ]
    scaling = TraceScaling(time_scale=0.5, length_scale=1 / 32, output_scale=0.1, max_output_len=2)
    workload = trace_workload(trace, scaling, TokenSource(1000, 0), "hand-made")
    specs = [s.next_request(None) for s in workload.sessions]
    prompts = [s.prompt for s in specs if s is not None]
    assert [len(p) for p in prompts] == [31, 47, 22]
    assert prompts[1][:31] == prompts[0]  # ids 0, 1 and the cut of block 1 are a prefix of the full block
    assert prompts[2][:16] == prompts[0][:16] and prompts[2][16:] != prompts[0][16:22]
    assert [s.arrival for s in workload.sessions] == [0.0, 1.0, 2.0]
    assert [s.max_tokens for s in specs if s is not None] == [1, 2, 2]
    assert workload.info["trace_ideal_block_hit_ratio"] == pytest.approx(3 / 7)


def test_trace_files_parse(tmp_path: Path) -> None:
    mooncake = tmp_path / "t.jsonl"
    mooncake.write_text('{"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]}\n')
    assert load_mooncake(mooncake) == [TraceRequest(1.5, 600, 5, (7, 8))]
    azure = tmp_path / "t.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
    )
    rows = load_azure(azure)
    assert [(r.input_length, r.output_length, r.hash_ids) for r in rows] == [(4808, 10, None), (3180, 8, None)]
    assert rows[1].timestamp == pytest.approx(0.052)
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:1"):
        load_mooncake(broken)


# ---------------------------------------------------------------------------- reports


def _result(records: list[RequestRecord], name: str) -> dict[str, object]:
    return {
        "summary": summarize(records, SLO(ttft=0.5)),
        "workload": {"name": name, "params": {"num_requests": len(records)}, "info": {}},
        "arrivals": {"mode": "closed", "concurrency": 4},
        "server": {"model": "m", "missing": ["/load"]},
        "provenance": {"git": {"commit": "abc"}, "host": {"cpu_count": 2}, "start_time": "t"},
    }


def test_summary_table_and_compare_show_ratios() -> None:
    fast = _result([record(0.0, [0.1, 0.2], 0.2, 2), record(0.0, [0.1, 0.2], 0.2, 2)], "random")
    slow = _result([record(0.0, [0.2, 0.4], 0.4, 2), record(0.0, [0.2, 0.4], 0.4, 2)], "random")
    table = summary_table(fast)
    assert "TTFT" in table and "100.00" in table and "server lacks: /load" in table
    compared = compare_table([fast, slow], ["fast", "slow"])
    ttft_row = next(line for line in compared.splitlines() if line.startswith("TTFT p50"))
    assert ttft_row.split()[-1] == "2.000x"
    requests_row = next(line for line in compared.splitlines() if line.startswith("requests/s"))
    assert requests_row.split()[-1] == "0.500x"


def test_compare_columns_stay_distinguishable_with_long_names() -> None:
    result = _result([record(0.0, [0.1, 0.2], 0.2, 2)], "random")
    names = ["results/run-2026-12-01/kvyard-a.json", "results/run-2026-12-01/kvyard-b.json"]
    lines = compare_table([result, result], names).splitlines()
    assert lines[:2] == [f"A = {names[0]}", f"B = {names[1]}"]
    assert lines[2].split() == ["metric", "A", "B", "x", "B"]

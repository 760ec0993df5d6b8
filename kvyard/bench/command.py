"""What `kvyard bench` runs once its options are read (kvyard/cli/bench.py): a benchmark from its settings, or
earlier results side by side."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from kvyard.bench.client import Arrivals, RequestOptions
from kvyard.bench.probe import ServerInfo
from kvyard.bench.records import RequestRecord
from kvyard.bench.report import compare_names, compare_table, summary_table
from kvyard.bench.runner import RunSettings, run_benchmark
from kvyard.bench.settings import (
    DEFAULT_NUM_REQUESTS,
    BenchSettings,
    LengthRange,
    MultiturnSettings,
    TraceSettings,
)
from kvyard.bench.traces import load_trace, resolve_trace
from kvyard.bench.workloads import (
    MultiturnShape,
    TokenSource,
    TraceScaling,
    Workload,
    multiturn_workload,
    random_workload,
    shared_prefix_workload,
    trace_workload,
)
from kvyard.net.http_client import HttpError


def run_bench(settings: BenchSettings, command: str) -> int:
    """Run, print the summary, write the result (and its plot): 0, or 1 when the run or any request failed.
    `command` is the command line the result records."""
    try:
        return _run(settings, command)
    except (HttpError, RuntimeError, OSError, ValueError) as error:
        print(f"kvyard bench: error: {error}", file=sys.stderr)
        return 1


def _run(settings: BenchSettings, command: str) -> int:
    result = run_benchmark(run_settings(settings, command), lambda server: build_workload(settings, server))
    print(summary_table(result))
    out, plot = settings.output.out, settings.output.plot
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {out}")
    if plot is not None:
        from kvyard.bench.plot import plot_result

        records = [RequestRecord.from_json(r) for r in result["requests"]]
        plot_result(records, f"{result['workload']['name']} — {result['server']['model']}", plot)
        print(f"plot: {plot}")
    return _report_failures(result)


def run_settings(settings: BenchSettings, command: str) -> RunSettings:
    server, load = settings.server, settings.load
    return RunSettings(
        options=RequestOptions(
            server.base_url.rstrip("/"),
            server.model,
            server.ignore_eos,
            server.temperature,
            server.api_key,
            server.timeout,
        ),
        arrivals=Arrivals(load.concurrency_limit(), load.request_rate, load.workload == "trace", load.seed),
        slo=load.slo,
        ideal_block_size=settings.output.ideal_block_size,
        progress=settings.output.progress,
        command=command,
    )


def build_workload(settings: BenchSettings, server: ServerInfo) -> Workload:
    load = settings.load
    source = TokenSource(settings.server.vocab_size, load.seed)
    count = load.num_requests or DEFAULT_NUM_REQUESTS
    if load.workload == "random":
        return random_workload(count, load.input_len, load.output_len, source)
    if load.workload == "shared-prefix":
        shared = settings.shared_prefix
        return shared_prefix_workload(
            count, shared.num_groups, shared.prefix_len, load.input_len, load.output_len, source
        )
    if load.workload == "multiturn":
        return multiturn_workload(_multiturn_shape(settings.multiturn, load.output_len, server), source)
    return _trace_workload(settings.replay, load.num_requests, source)


def _multiturn_shape(turns: MultiturnSettings, output_len: LengthRange, server: ServerInfo) -> MultiturnShape:
    return MultiturnShape(
        turns.num_sessions,
        turns.turns,
        turns.system_len,
        turns.first_len,
        turns.turn_len,
        output_len,
        turns.think_time,
        turns.rewrite_prob,
        turns.max_context or server.max_model_len,
    )


def _trace_workload(replay: TraceSettings, limit: int | None, source: TokenSource) -> Workload:
    path = resolve_trace(replay.trace)
    scaling = TraceScaling(
        replay.time_scale, replay.length_scale, replay.output_scale, replay.max_input_len, replay.max_output_len
    )
    return trace_workload(load_trace(path, limit), scaling, source, str(path))


def _report_failures(result: dict[str, Any]) -> int:
    """1 (and the servers' reasons on stderr) when any request failed: a run with failures measured something
    else than asked."""
    requests = result["summary"]["requests"]
    if not requests["failed"]:
        return 0
    failed = [r for r in result["requests"] if r["error"]]
    print(f"kvyard bench: error: {requests['failed']} of {requests['total']} requests failed", file=sys.stderr)
    for kind, count in Counter(r["error"] for r in failed).most_common():
        example = next(r.get("error_message") or "" for r in failed if r["error"] == kind)
        print(f"  {count} x {kind}, e.g.: {_server_message(example)[:300]}", file=sys.stderr)
    return 1


def _server_message(text: str) -> str:
    """The message of an OpenAI-style error body, else the text as it is."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text


def compare_results(paths: list[Path]) -> int:
    """Earlier results side by side, with ratios to the first: 0, or 2 when one cannot be read."""
    try:
        results = [json.loads(p.read_text()) for p in paths]
    except (OSError, json.JSONDecodeError) as error:
        print(f"kvyard bench compare: error: {error}", file=sys.stderr)
        return 2
    print(compare_table(results, compare_names(paths)))
    return 0

"""One benchmark run: probe the server, snapshot its metrics, drive the load, assemble the result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from tqdm import tqdm

from kvyard.bench import provenance
from kvyard.bench.client import Arrivals, LoadClient, RequestOptions
from kvyard.bench.metrics import SLO, summarize
from kvyard.bench.probe import ServerInfo, counted_by_server, get_json, metrics_snapshot, probe_server
from kvyard.bench.records import RequestRecord
from kvyard.bench.workloads import Workload, count_rewrites
from kvyard.net.http_client import HttpClient

RESULT_FORMAT = 1
PROGRESS_EVERY_S = 0.25  # how often the progress bar shows the requests under way


@dataclass(frozen=True, slots=True)
class RunSettings:
    options: RequestOptions
    arrivals: Arrivals
    slo: SLO | None = None
    ideal_block_size: int = 16
    progress: bool = True
    command: str = ""


def run_benchmark(settings: RunSettings, build_workload: Callable[[ServerInfo], Workload]) -> dict[str, Any]:
    """Run and return the result document (see docs/bench.md)."""
    return asyncio.run(_run(settings, build_workload))


async def _run(settings: RunSettings, build_workload: Callable[[ServerInfo], Workload]) -> dict[str, Any]:
    start_time = provenance.utc_now()
    base_url = settings.options.base_url
    http = HttpClient(base_url, settings.options.headers())
    try:
        server = await probe_server(http, settings.options.model)
        workload = build_workload(server)
        before = await metrics_snapshot(http)
        options = replace(
            settings.options, model=server.model, ignore_eos=settings.options.ignore_eos and server.ignore_eos
        )
        records, cost, origin = await _drive(settings, options, workload)
        after = await metrics_snapshot(http)
        load_after = await get_json(http, "/load") if "/load" not in server.missing else None
    finally:
        http.close()
    summary = summarize(records, settings.slo)
    # The client's own CPU while it ran: near one core's worth of wall time means the client, not the
    # server, may have set the pace.
    summary["client_wall_s"] = cost.wall
    summary["client_cpu_s"] = cost.cpu
    summary["client_cpu_per_request_ms"] = cost.cpu * 1000 / len(records) if records else None
    # Record times are seconds after this moment of time.monotonic(), so they can be joined with server logs.
    summary["clock_origin_monotonic"] = origin
    return {
        "format": RESULT_FORMAT,
        "summary": summary,
        "workload": {
            "name": workload.name,
            "params": workload.params,
            "seed": settings.arrivals.seed,
            "info": {**workload.info, **_workload_stats(workload)},
        },
        "arrivals": {**asdict(settings.arrivals), "mode": settings.arrivals.mode},
        "request": {
            "endpoint": "/v1/completions",
            "stream": True,
            "model": options.model,
            "ignore_eos": options.ignore_eos,
            "temperature": options.temperature,
            "timeout_s": options.timeout,
            "ideal_block_size": settings.ideal_block_size,
        },
        "server": {
            **server.to_json(),
            "base_url": base_url,
            "load_after": load_after,
            "metrics_before": before,
            "metrics_after": after,
            "counted": counted_by_server(before, after),
        },
        "provenance": {
            "command": settings.command,
            "git": provenance.git_state(),
            "host": provenance.host(),
            "start_time": start_time,
            "end_time": provenance.utc_now(),
        },
        "requests": [r.to_json() for r in records],
    }


async def _drive(
    settings: RunSettings, options: RequestOptions, workload: Workload
) -> tuple[list[RequestRecord], ClientCost, float]:
    bar = tqdm(total=workload.num_requests, unit="req", disable=not settings.progress, dynamic_ncols=True)
    failures = 0

    def under_way() -> str:
        """Beside the finished requests: what is running, so long requests show progress before one ends."""
        now = client.progress()
        text = f"in flight {now.in_flight}, streaming {now.streaming}, {now.chunks} chunks out"
        return text + (f", {failures} failed" if failures else "")

    def done(record: RequestRecord) -> None:
        nonlocal failures
        failures += not record.ok
        bar.update(1)
        bar.set_postfix_str(under_way(), refresh=False)

    async def show_under_way() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            bar.set_postfix_str(under_way())

    client = LoadClient(options, settings.arrivals, settings.ideal_block_size, done)
    started, cpu = time.perf_counter(), time.process_time()
    shown = asyncio.create_task(show_under_way()) if settings.progress else None
    try:
        records = await client.run(workload)
    finally:
        if shown is not None:
            shown.cancel()
        bar.close()
    return records, ClientCost(time.perf_counter() - started, time.process_time() - cpu), client.origin


@dataclass(frozen=True, slots=True)
class ClientCost:
    wall: float
    cpu: float  # this process's CPU seconds (user + system) during the run


def _workload_stats(workload: Workload) -> dict[str, Any]:
    return {"rewrites": count_rewrites(workload)} if workload.name == "multiturn" else {}

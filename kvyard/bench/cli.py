"""`kvyard bench …` (run a workload) and `kvyard bench compare a.json b.json …`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvyard.bench.client import Arrivals, RequestOptions
from kvyard.bench.metrics import parse_slo
from kvyard.bench.probe import ServerInfo
from kvyard.bench.provenance import command_line
from kvyard.bench.records import RequestRecord
from kvyard.bench.report import compare_names, compare_table, summary_table
from kvyard.bench.runner import RunSettings, run_benchmark
from kvyard.bench.traces import load_trace, resolve_trace
from kvyard.bench.workloads import (
    WORKLOADS,
    LengthRange,
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

T = TypeVar("T")
EPILOG = """examples:
  kvyard bench --base-url http://127.0.0.1:8000 --workload random --num-requests 100 --concurrency 16 \\
      --input-len 8192 --output-len 1024 --out result.json
  kvyard bench --base-url URL --workload trace --trace mooncake --num-requests 200 --length-scale 0.03125 \\
      --time-scale 0.1 --out trace.json --plot trace.png
  kvyard bench compare a.json b.json"""


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible endpoint (or: bench compare a.json b.json …)",
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "compare",
        nargs="*",
        metavar="compare FILE",
        help="`compare a.json b.json …`: earlier results side by side, with ratios",
    )
    _add_run_arguments(parser)
    parser.set_defaults(handler=main, command_line=None)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and shows every option's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default is not None
            and default is not argparse.SUPPRESS
            and not isinstance(default, bool)
        ):
            text += " (default: %(default)s)"
        return text


def _typed(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type that shows the parser's own message instead of "invalid value"."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    return convert


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (without /v1)")
    server.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    server.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    server.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (output lengths are then up to the model)",
    )
    server.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    server.add_argument(
        "--vocab-size",
        type=int,
        default=1000,
        help="prompt token ids are drawn from [0, N); 1000 fits every kvyard preset",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--workload", choices=WORKLOADS, default="random", help="what to send (options per workload below)"
    )
    load.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests (random, shared-prefix: default 100; trace: a limit, default all)",
    )
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: requests in flight (default 1); with --request-rate, a cap",
    )
    load.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    load.add_argument(
        "--input-len",
        type=_typed(LengthRange.parse),
        default=LengthRange(1024, 1024),
        help="prompt tokens: N or LOW:HIGH (shared-prefix: after the prefix)",
    )
    load.add_argument(
        "--output-len",
        type=_typed(LengthRange.parse),
        default=LengthRange(128, 128),
        help="output tokens: N or LOW:HIGH",
    )
    load.add_argument("--seed", type=int, default=0, help="seed of the workload's random choices")
    load.add_argument(
        "--slo", type=_typed(parse_slo), default=None, help="goodput objectives, e.g. ttft=500ms,tpot=50ms"
    )

    shared = parser.add_argument_group("shared-prefix")
    shared.add_argument("--num-groups", type=int, default=4, help="groups of requests sharing a prefix")
    shared.add_argument("--prefix-len", type=int, default=1024, help="tokens of each shared prefix")

    turns = parser.add_argument_group("multiturn")
    turns.add_argument("--num-sessions", type=int, default=8, help="concurrent conversations")
    turns.add_argument("--turns", type=int, default=5, help="turns per conversation")
    turns.add_argument("--system-len", type=int, default=1024, help="system prompt shared by every session")
    turns.add_argument(
        "--first-len",
        type=_typed(LengthRange.parse),
        default=LengthRange(512, 512),
        help="tokens of each session's first message",
    )
    turns.add_argument(
        "--turn-len",
        type=_typed(LengthRange.parse),
        default=LengthRange(128, 128),
        help="new tokens in every later turn",
    )
    turns.add_argument("--think-time", type=float, default=0.0, help="mean seconds between turns (exponential)")
    turns.add_argument(
        "--rewrite-prob", type=float, default=0.0, help="chance that a turn rewrites the middle of the history first"
    )
    turns.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="compact histories beyond this (default: the server's max_model_len)",
    )

    trace = parser.add_argument_group("trace")
    trace.add_argument(
        "--trace",
        default="mooncake",
        help="mooncake, azure (public traces kvyard ships) or a .jsonl/.csv path (.gz too)",
    )
    trace.add_argument("--time-scale", type=float, default=1.0, help="arrival times are multiplied by this")
    trace.add_argument("--length-scale", type=float, default=1.0, help="input lengths are multiplied by this")
    trace.add_argument("--output-scale", type=float, default=1.0, help="output lengths are multiplied by this")
    trace.add_argument("--max-input-len", type=int, default=None, help="cap on scaled prompts (keeps the prefix)")
    trace.add_argument("--max-output-len", type=int, default=None, help="cap on scaled outputs")

    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="result JSON")
    out.add_argument("--plot", type=Path, default=None, help="PNG: TTFT/ITL CDFs and TTFT over time")
    out.add_argument(
        "--ideal-block-size",
        type=int,
        default=16,
        help="block size for the ideal prefix hit ratio (match the server's)",
    )
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run_cli(argv: list[str]) -> int:
    """`kvyard bench ARGV…` without the rest of kvyard's command line (scripts, tests)."""
    parser = argparse.ArgumentParser(prog="kvyard")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    args.command_line = shlex.join(["kvyard", "bench", *argv])
    return main(args)


def main(args: argparse.Namespace) -> int:
    if args.compare:
        return _compare(args.compare)
    try:
        _check(args)
    except ValueError as error:
        print(f"kvyard bench: error: {error}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except (HttpError, RuntimeError, OSError, ValueError) as error:
        print(f"kvyard bench: error: {error}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    settings = RunSettings(
        options=RequestOptions(
            args.base_url.rstrip("/"), args.model, args.ignore_eos, args.temperature, args.api_key, args.timeout
        ),
        arrivals=Arrivals(
            args.concurrency if args.concurrency or args.request_rate else _default_concurrency(args),
            args.request_rate,
            args.workload == "trace",
            args.seed,
        ),
        slo=args.slo,
        ideal_block_size=args.ideal_block_size,
        progress=args.progress,
        command=args.command_line or command_line(),
    )
    result = run_benchmark(settings, lambda server: build_workload(args, server))
    print(summary_table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {args.out}")
    if args.plot is not None:
        from kvyard.bench.plot import plot_result

        records = [RequestRecord.from_json(r) for r in result["requests"]]
        plot_result(records, f"{result['workload']['name']} — {result['server']['model']}", args.plot)
        print(f"plot: {args.plot}")
    return _report_failures(result)


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


def _default_concurrency(args: argparse.Namespace) -> int | None:
    """Trace arrivals need no bound; every other workload defaults to one request at a time."""
    return None if args.workload == "trace" else 1


def _check(args: argparse.Namespace) -> None:
    if args.compare:
        return
    if not args.base_url:
        raise ValueError("--base-url is required (or use `kvyard bench compare a.json b.json …`)")
    positive = {
        "--num-requests": args.num_requests,
        "--concurrency": args.concurrency,
        "--num-groups": args.num_groups,
        "--num-sessions": args.num_sessions,
        "--turns": args.turns,
        "--vocab-size": args.vocab_size,
        "--ideal-block-size": args.ideal_block_size,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
    if not 0 <= args.rewrite_prob <= 1:
        raise ValueError(f"--rewrite-prob must be in [0, 1], got {args.rewrite_prob}")
    for flag in ("time_scale", "length_scale", "output_scale"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")


def build_workload(args: argparse.Namespace, server: ServerInfo) -> Workload:
    source = TokenSource(args.vocab_size, args.seed)
    count = args.num_requests or 100
    if args.workload == "random":
        return random_workload(count, args.input_len, args.output_len, source)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(count, args.num_groups, args.prefix_len, args.input_len, args.output_len, source)
    if args.workload == "multiturn":
        shape = MultiturnShape(
            args.num_sessions,
            args.turns,
            args.system_len,
            args.first_len,
            args.turn_len,
            args.output_len,
            args.think_time,
            args.rewrite_prob,
            args.max_context or server.max_model_len,
        )
        return multiturn_workload(shape, source)
    path = resolve_trace(args.trace)
    scaling = TraceScaling(
        args.time_scale, args.length_scale, args.output_scale, args.max_input_len, args.max_output_len
    )
    return trace_workload(load_trace(path, args.num_requests), scaling, source, str(path))


def _compare(words: list[str]) -> int:
    if words[0] != "compare" or len(words) < 2:
        print("kvyard bench: error: positional arguments are only for `compare a.json b.json …`", file=sys.stderr)
        return 2
    paths = [Path(w) for w in words[1:]]
    try:
        results = [json.loads(p.read_text()) for p in paths]
    except (OSError, json.JSONDecodeError) as error:
        print(f"kvyard bench compare: error: {error}", file=sys.stderr)
        return 2
    print(compare_table(results, compare_names(paths)))
    return 0

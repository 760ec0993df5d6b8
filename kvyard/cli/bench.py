"""`kvyard bench …` (run a workload) and `kvyard bench compare a.json b.json …`.

The options are generated from `BenchSettings` (kvyard/bench/settings.py); the load client is imported when a
run starts (kvyard/bench/command.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from kvyard.bench.provenance import command_line
from kvyard.bench.settings import BenchSettings
from kvyard.cli.options import add_config_options, config_from_args

EPILOG = """examples:
  kvyard bench --base-url http://127.0.0.1:8000 --workload random --num-requests 100 --concurrency 16 \\
      --input-len 8192 --output-len 1024 --out result.json
  kvyard bench --base-url URL --workload trace --trace mooncake --num-requests 200 --length-scale 0.03125 \\
      --time-scale 0.1 --out trace.json --plot trace.png
  kvyard bench compare a.json b.json"""


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible endpoint (or: bench compare a.json b.json …)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the examples' layout
    )
    # Not a setting: `compare` names files to read instead of a run. A positional, not a subcommand, so that a
    # run needs none (`kvyard bench --base-url URL`).
    parser.add_argument(
        "compare",
        nargs="*",
        metavar="compare FILE",
        help="`compare a.json b.json …`: earlier results side by side, with ratios",
    )
    add_config_options(parser, BenchSettings)
    parser.set_defaults(handler=main, command_line=None)


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
    if not args.base_url:
        return _fail("--base-url is required (or use `kvyard bench compare a.json b.json …`)")
    try:
        settings = config_from_args(BenchSettings, args)
    except (ValueError, TypeError) as error:
        return _fail(str(error))
    from kvyard.bench.command import run_bench

    return run_bench(settings, args.command_line or command_line())


def _compare(words: list[str]) -> int:
    if words[0] != "compare" or len(words) < 2:
        return _fail("positional arguments are only for `compare a.json b.json …`")
    from kvyard.bench.command import compare_results

    return compare_results([Path(word) for word in words[1:]])


def _fail(message: str) -> int:
    print(f"kvyard bench: error: {message}", file=sys.stderr)
    return 2

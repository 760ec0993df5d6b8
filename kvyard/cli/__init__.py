"""`kvyard` command line: create-model, convert, generate, serve, sim, route, deploy, bench.

Building the parser imports only settings and light modules, so `--help` and argument errors answer at
once; each command imports what it runs (torch, for the engine) when it runs. A command line that names a
command builds that command's parser alone: `kvyard serve` does not import the benchmark client or the
simulator to parse its options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command -> module with add_parser(commands) that sets `handler`
COMMANDS = {
    "create-model": "kvyard.cli.create_model",
    "convert": "kvyard.cli.convert",
    "generate": "kvyard.cli.generate",
    "serve": "kvyard.cli.serve",
    "sim": "kvyard.cli.sim",
    "route": "kvyard.cli.route",
    "deploy": "kvyard.cli.deploy",
    "bench": "kvyard.cli.bench",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of the one `argv` names first (its other options are its own)."""
    parser = argparse.ArgumentParser(prog="kvyard", description="kvyard: an open LLM serving stack")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = argv[0] if argv and argv[0] in COMMANDS else None
    for command, module in COMMANDS.items():
        if named is None or command == named:
            importlib.import_module(module).add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # answered with the command's own usage, not kvyard's list of commands
        command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        result: int = args.handler(args)
    except KeyboardInterrupt:
        return 130
    return result


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one command, from kvyard's parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[command]
            return found
    raise KeyError(command)


def fail(message: str, code: int = 2) -> int:
    """Say why on stderr; the exit code to return."""
    print(f"kvyard: error: {message}", file=sys.stderr)
    return code

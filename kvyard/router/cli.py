"""`kvyard route`: arguments and entry point (the server modules load only when the command runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvyard.router.config import POLICIES

DESCRIPTION = "Cache-aware OpenAI-compatible gateway across replicas."


def add_route_command(commands: Any) -> None:
    add_route_arguments(commands.add_parser("route", help=DESCRIPTION, description=DESCRIPTION))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvyard.router", description=DESCRIPTION)
    add_route_arguments(parser)
    args = parser.parse_args(argv)
    return run_route(args)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="replica base URL (repeatable; more via POST /admin/replicas at run time)")  # fmt: skip
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--session-header", default="x-session-id", help="header that names a session "
                        "(policy session; the request's 'user' field otherwise)")  # fmt: skip
    parser.add_argument("--max-in-flight", type=int, default=4096, help="requests proxied at once before 429")
    parser.add_argument("--max-attempts", type=int, default=3, help="replicas tried before the first byte")
    parser.add_argument("--health-interval", type=float, default=0.5, help="seconds between health checks")
    parser.add_argument("--recompute-weight", type=float, default=1.0, help="cache_aware: weight of the "
                        "prefill work a replica adds to the fleet by not reusing another's cache")  # fmt: skip
    parser.add_argument("--attention-pair-cost", type=float, default=3.5e-4, help="cache_aware: cost of one "
                        "(query, key) pair of prefill attention, in prefill-token equivalents")  # fmt: skip
    parser.add_argument("--session-recompute-weight", type=float, default=300.0, help="cache_aware: the same "
                        "for moving a session away from the replica that served its last turn")  # fmt: skip
    parser.add_argument("--log-level", default="warning")
    parser.set_defaults(handler=run_route)


def run_route(args: argparse.Namespace) -> int:
    import logging

    from kvyard.router.app import serve
    from kvyard.router.config import RouterConfig

    logging.basicConfig(level=args.log_level.upper())
    try:
        config = RouterConfig(policy=args.policy, session_header=args.session_header.lower(),
                              max_in_flight=args.max_in_flight, max_attempts=args.max_attempts,
                              health_interval_s=args.health_interval, recompute_weight=args.recompute_weight,
                              attention_pair_cost=args.attention_pair_cost,
                              session_recompute_weight=args.session_recompute_weight)  # fmt: skip
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import uvloop

    uvloop.run(serve(config, args.replica, args.host, args.port))
    return 0

"""`kvyard route`: the cache-aware OpenAI-compatible gateway across replicas."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvyard.api.auth import REPLICA_ADMIN_KEY_ENV
from kvyard.api.engine_kv_events import EventEndpoints
from kvyard.cli import fail
from kvyard.cli.options import add_config_options, add_log_level_option, config_from_args, configure_logging
from kvyard.router.config import RouterConfig

DESCRIPTION = "Cache-aware OpenAI-compatible gateway across replicas."


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser("route", help=DESCRIPTION, description=DESCRIPTION)
    parser.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="replica base URL (repeatable; more via POST /admin/replicas at run time)",
    )
    parser.add_argument(
        "--replica-events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="the KV-event publisher of the vLLM or SGLang replica given by the --replica in the "
        "same position: tcp://HOST:PORT, or tcp://HOST:PORT,tcp://HOST:REPLAY_PORT with its replay "
        "socket ('-' for a replica without one; kvyard replicas need none)",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill replica (repeatable): prefills requests whose decode runs on a decode replica; "
        "needs --replica-admin-key",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode replica (repeatable; a --replica reporting role decode counts too)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    add_log_level_option(parser)
    add_config_options(parser, RouterConfig)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        config = config_from_args(RouterConfig, args)
    except (ValueError, TypeError) as error:
        return fail(str(error))
    if len(args.replica_events) > len(args.replica):
        return fail(
            f"{len(args.replica_events)} --replica-events for {len(args.replica)} --replica: each names the "
            "events of the --replica in the same position"
        )
    try:
        events = [None if text == "-" else EventEndpoints.parse(text) for text in args.replica_events]
    except ValueError as error:
        return fail(f"--replica-events: {error}")
    if args.prefill and not (config.replica_admin_key or os.environ.get(REPLICA_ADMIN_KEY_ENV)):
        return fail(
            "--prefill needs --replica-admin-key (or $KVYARD_REPLICA_ADMIN_KEY): replicas accept "
            "disaggregated requests only with their admin key"
        )
    import uvloop

    from kvyard.router.app import serve

    uvloop.run(serve(config, args.replica, args.host, args.port, args.prefill, args.decode, events))
    return 0

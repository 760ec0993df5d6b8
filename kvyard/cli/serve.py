"""`kvyard serve`: one replica of a model behind the OpenAI-compatible API."""

from __future__ import annotations

import argparse
from typing import Any

from kvyard.cli import fail
from kvyard.cli.models import add_engine_options, add_model_argument, engine_config_from_args
from kvyard.cli.options import add_config_options, config_from_args
from kvyard.kernels.threads import reserve_threads_for_engine
from kvyard.server.options import ServerOptions

DESCRIPTION = """Serve one model over the OpenAI-compatible API (/v1/completions, /v1/chat/completions), plus
/health, /metrics, /load, /tokenize and the KV-event stream (/kv/events, /kv/snapshot) that routers read.
It listens at once; /health answers 503 until the model has loaded."""


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server for one replica", description=DESCRIPTION
    )
    add_model_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    add_engine_options(parser)
    add_config_options(parser, ServerOptions)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    reserve_threads_for_engine()  # before anything loads PyTorch or the kernels
    try:
        options = config_from_args(ServerOptions, args)
        engine = engine_config_from_args(args, record_kv_events=True)
    except (ValueError, TypeError) as error:
        return fail(str(error))
    from kvyard.server.model_server import serve_model

    return serve_model(engine, options, args.host, args.port)

"""Model arguments shared by the commands that run an engine."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvyard.cli.options import add_config_options, config_from_args
from kvyard.engine.config import EngineConfig


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face model directory (default: the embedded demo model, created on first use "
                        "under $KVYARD_CACHE_DIR or ~/.cache/kvyard)")  # fmt: skip


def resolve_model_dir(model: str | None) -> str:
    """The given model directory, or the embedded default model (created on first use)."""
    if model:
        return model
    from kvyard.testing.create_model import default_model_dir, ensure_default_model

    if not default_model_dir().is_dir():
        print(f"kvyard: no model given: creating the embedded demo model in {default_model_dir()} "
              "(once; about a minute) ...", file=sys.stderr, flush=True)  # fmt: skip
    return str(ensure_default_model())


def add_engine_options(parser: argparse.ArgumentParser, **overrides: Any) -> None:
    """The engine's settings, its scheduler's and its KV tier's, as options."""
    add_config_options(parser, EngineConfig, **overrides)


def engine_config_from_args(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """The engine config of the parsed options; `--kv-tier none` turns the tier off."""
    if args.tiers == ("none",):
        fixed["kv_tier"] = None
    config = config_from_args(EngineConfig, args, model="", **fixed)  # checks the options first
    config.model = resolve_model_dir(args.model)
    return config

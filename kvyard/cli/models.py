"""Model arguments shared by the commands that run an engine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvyard.cli.options import add_config_options, config_from_args
from kvyard.engine.config import EngineConfig


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face model directory (default: the embedded demo model, a small Llama trained "
        "on Python, kvyard/testing/kvyard-demo)",
    )


def resolve_model_dir(model: str | None, doing: str = "serving") -> str:
    """The given model directory, or the embedded demo model; ValueError for a path that does not exist (said
    before a server prints where it listens). `doing`: what the command does with it, for the message."""
    if model:
        if not Path(model).exists():
            raise ValueError(
                f"no such model directory: {model} (a Hugging Face checkpoint or a kvyard weight "
                "package; no model at all means the embedded demo model)"
            )
        return model
    from kvyard.testing.model_presets import DEMO_MODEL_DIR

    print(f"kvyard: no model given: {doing} the embedded demo model ({DEMO_MODEL_DIR})", file=sys.stderr, flush=True)
    return str(DEMO_MODEL_DIR)


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

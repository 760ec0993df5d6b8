"""`kvyard create-model`: a model with random weights in a real architecture, with a locally trained tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvyard.cli import fail
from kvyard.testing.model_presets import ARCHITECTURES, DTYPES, MOE_ARCHITECTURES, PRESETS


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "create-model",
        help="write a random-weight model and a local tokenizer in Hugging Face format",
        description="Write a model with random weights in a real architecture and a byte-level BPE tokenizer "
        "trained locally, in Hugging Face format (config.json, model.safetensors, tokenizer files), for tests "
        "and demos where no checkpoint can be downloaded.",
    )
    parser.add_argument(
        "--arch", choices=ARCHITECTURES + MOE_ARCHITECTURES, default="llama", help="architecture (default: llama)"
    )
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="size: tiny (tests), small, bench (the demo model, ~56M parameters) (default: tiny)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the weights (default: float32)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvyard.testing.create_model import create_model

    try:
        print(create_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype))
    except (OSError, ValueError) as error:
        return fail(str(error))
    return 0

"""`kvyard convert`: write a weight package (a model directory with its weights already in kvyard's int8 format)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvyard.cli import fail


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "convert", help="write a weight package: the model's weights converted once, loaded as they are",
        description="Convert a Hugging Face model directory's linear-layer weights to int8 (a scale per 32 "
        "weights) and write them, with the config and tokenizer files and a description checked at load time, "
        "as a package that `kvyard serve PACKAGE` and `LLM(PACKAGE)` load without converting again.",
    )  # fmt: skip
    parser.add_argument("model", type=Path, help="the Hugging Face model directory to convert")
    parser.add_argument("--weights", choices=("int8",), default="int8", help="weight format (default: int8)")
    parser.add_argument("--out", type=Path, required=True, help="the package directory to write (new or empty)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvyard.models.package import convert

    started = time.monotonic()
    print(f"kvyard: converting {args.model} to {args.weights} weights ...", flush=True)
    try:
        info = convert(args.model, args.weights, args.out)
    except (OSError, ValueError) as error:
        return fail(str(error), 1)
    size_mb = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file()) / 1e6
    print(f"kvyard: wrote {args.out} ({info.weights}, groups of {info.group_size}, {size_mb:.1f} MB) in "
          f"{time.monotonic() - started:.1f} s")  # fmt: skip
    return 0

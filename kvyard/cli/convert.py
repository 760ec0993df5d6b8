"""`kvyard convert`: write a weight package (a model directory with its weights already converted: int8, fp16, bf16)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvyard.cli import fail
from kvyard.cli.models import resolve_model_dir
from kvyard.models import PACKAGE_SCHEMES


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "convert",
        help="write a weight package: the model's weights converted once, loaded as they are",
        description="Convert a Hugging Face model directory's linear-layer weights to int8 (a scale per 32 "
        "weights), fp16 or bf16 and write them, with the config and tokenizer files and a description checked at "
        "load time, "
        "as a package that `kvyard serve PACKAGE` and `LLM(PACKAGE)` load without converting again.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="the Hugging Face model directory to convert "
        "(default: the embedded demo model, kvyard/testing/kvyard-demo)",
    )
    parser.add_argument(
        "--weights",
        choices=PACKAGE_SCHEMES,
        default="int8",
        help="weight format: int8 (a scale per 32 weights), fp16 or bf16 (default: int8)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the package directory to write (new or empty)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvyard.models.package import convert

    started = time.monotonic()
    try:
        model = resolve_model_dir(args.model, "converting")
        print(f"kvyard: converting {model} to {args.weights} weights ...", flush=True)
        info = convert(model, args.weights, args.out)
    except (OSError, ValueError) as error:
        return fail(str(error), 1)
    size_mb = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file()) / 1e6
    scheme = f"{info.weights}, groups of {info.group_size}" if info.group_size else info.weights
    print(f"kvyard: wrote {args.out} ({scheme}, {size_mb:.1f} MB) in {time.monotonic() - started:.1f} s")
    return 0

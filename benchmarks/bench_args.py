"""The command-line start the benchmark scripts share: a description from the docstring, and the work directory."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

WORK_DIR_ENV = "KVYARD_BENCH_DIR"
DEFAULT_WORK_DIR = "/tmp/kvyard-bench"


def parser_with_work_dir(doc: str, holds: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of `doc`, with `--work-dir` (what it `holds`, for its help)."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(os.environ.get(WORK_DIR_ENV, DEFAULT_WORK_DIR)),
        help=f"{holds} (${WORK_DIR_ENV})",
    )
    return parser

"""Public request traces: the Mooncake JSONL format and the Azure LLM inference CSV format."""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

MOONCAKE_BLOCK_TOKENS = 512
TRACE_DIR = Path(__file__).resolve().parent / "trace_files"  # shipped with kvyard: see SOURCES.md there
TRACE_FILES = {"mooncake": "mooncake_conversation.jsonl.gz", "azure": "azure_llm_2023_code.csv.gz"}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # seconds since the first request of the file
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None  # one id per 512-token prefix block (Mooncake); None when unknown


def resolve_trace(name_or_path: str) -> Path:
    """`mooncake` and `azure` name the traces kvyard ships; anything else is a path (.jsonl or .csv, maybe .gz)."""
    if name_or_path in TRACE_FILES:
        return TRACE_DIR / TRACE_FILES[name_or_path]
    return Path(name_or_path)


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if path.name.removesuffix(".gz").endswith(".csv"):
        return load_azure(path, limit)
    return load_mooncake(path, limit)


def open_text(path: Path) -> TextIO:
    """A trace file's text, gzip-compressed or not."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="")
    return path.open(newline="")


def load_mooncake(path: Path, limit: int | None = None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    with open_text(path) as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(
                    TraceRequest(
                        row["timestamp"] / 1000,
                        int(row["input_length"]),
                        int(row["output_length"]),
                        tuple(int(h) for h in row["hash_ids"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line ({error})") from error
    return requests


def load_azure(path: Path, limit: int | None = None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    first: datetime | None = None
    with open_text(path) as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                stamp = _azure_time(row["TIMESTAMP"])
                first = first or stamp
                requests.append(
                    TraceRequest(
                        (stamp - first).total_seconds(), int(row["ContextTokens"]), int(row["GeneratedTokens"]), None
                    )
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{number}: not an Azure trace row ({error})") from error
    return requests


def _azure_time(text: str) -> datetime:
    """`2023-11-16 18:17:03.9799600`: seven fractional digits, more than datetime parses."""
    whole, _, fraction = text.strip().partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction or '0')[:6].ljust(6, '0')}")

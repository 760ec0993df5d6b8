"""Public request traces: the Mooncake JSONL format and the Azure LLM inference CSV format."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import kvyard

MOONCAKE_BLOCK_TOKENS = 512
TRACE_FILES = {
    "mooncake": "traces/mooncake/conversation_trace.jsonl",
    "azure": "traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv",
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # seconds since the first request of the file
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] | None  # one id per 512-token prefix block (Mooncake); None when unknown


def shared_dir() -> Path:
    """`../shared` next to the repository kvyard runs from."""
    return Path(kvyard.__file__).resolve().parent.parent.parent / "shared"


def resolve_trace(name_or_path: str) -> Path:
    """`mooncake` and `azure` name the traces in ../shared; anything else is a path."""
    if name_or_path in TRACE_FILES:
        return shared_dir() / TRACE_FILES[name_or_path]
    return Path(name_or_path)


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if path.suffix == ".csv":
        return load_azure(path, limit)
    return load_mooncake(path, limit)


def load_mooncake(path: Path, limit: int | None = None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    with path.open() as lines:
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
    with path.open(newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                stamp = _azure_time(row["TIMESTAMP"])
                first = first or stamp
                requests.append(TraceRequest((stamp - first).total_seconds(), int(row["ContextTokens"]),
                                             int(row["GeneratedTokens"]), None))  # fmt: skip
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{path}:{number}: not an Azure trace row ({error})") from error
    return requests


def _azure_time(text: str) -> datetime:
    """`2023-11-16 18:17:03.9799600`: seven fractional digits, more than datetime parses."""
    whole, _, fraction = text.strip().partition(".")
    return datetime.fromisoformat(f"{whole}.{(fraction or '0')[:6].ljust(6, '0')}")

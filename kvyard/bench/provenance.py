"""The conditions of a run, written next to its numbers: command, code version, host."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import kvyard


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def command_line(argv: list[str] | None = None) -> str:
    return shlex.join(sys.argv if argv is None else argv)


def of_run() -> dict[str, Any]:
    """What a benchmark script writes beside its conditions: its command line, kvyard's commit, the host, when."""
    return {"command": command_line(), "git": git_state(), "host": host(), "start_time": utc_now()}


def git_state() -> dict[str, Any]:
    """kvyard's commit and whether the working tree had uncommitted changes."""
    repo = Path(kvyard.__file__).resolve().parent.parent
    commit = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    status = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def host() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "gpus": _gpus(),
    }


def _cpu_model() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    listing = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return [line.strip() for line in (listing or "").splitlines() if line.strip()]


def _run(command: list[str]) -> str | None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None

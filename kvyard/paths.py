"""Where kvyard keeps files between runs (models it creates, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$KVYARD_CACHE_DIR, else $XDG_CACHE_HOME/kvyard, else ~/.cache/kvyard."""
    if env := os.environ.get("KVYARD_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvyard"

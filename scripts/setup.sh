#!/usr/bin/env bash
# Create .venv with kvyard and its test tools. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first and pinned: 2.13.0 is the CPU build available here; an unpinned torch would pull CUDA.
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[dev]"
# The KV tier's Redis tests start their own redis-server on loopback (CI runs as root on fresh Debian).
if ! command -v redis-server >/dev/null 2>&1; then
    as_root=""
    if [ "$(id -u)" -ne 0 ]; then as_root="sudo"; fi
    $as_root apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

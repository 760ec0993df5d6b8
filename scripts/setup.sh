#!/usr/bin/env bash
# Create .venv with kvyard and its development tools. Safe to run again: it only installs what is missing.
#   bash scripts/setup.sh          to serve, generate, route and benchmark
#   bash scripts/setup.sh --fleet  also Ray, for `kvyard deploy` (fleets across machines)
#   bash scripts/setup.sh --tests  also Ray and redis-server, which the fleet and KV-tier tests start on loopback
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
with_fleet=0
for argument in "$@"; do
    case "$argument" in
        --tests) with_tests=1; with_fleet=1 ;;
        --fleet) with_fleet=1 ;;
        -h|--help) sed -n '2,5s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown argument $argument (try --help)" >&2; exit 2 ;;
    esac
done

step() {  # step NUMBER TOTAL TEXT COMMAND...: say what runs, run it, say how long it took
    local number=$1 total=$2 text=$3
    shift 3
    local started=$SECONDS
    echo "setup [$number/$total] $text ..."
    "$@"
    echo "setup [$number/$total] done in $((SECONDS - started)) s"
}

pip_install() {
    .venv/bin/pip install --quiet --disable-pip-version-check "$@"
}

install_redis() {
    if command -v redis-server >/dev/null 2>&1; then
        echo "  redis-server is already installed"
        return
    fi
    local as_root=""
    if [ "$(id -u)" -ne 0 ]; then as_root="sudo"; fi
    $as_root apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
}

total=$((3 + with_tests))
step 1 "$total" "virtual environment .venv" python3 -m venv .venv
# torch first and pinned: 2.13.0 is the CPU build available here; an unpinned torch would pull CUDA.
step 2 "$total" "PyTorch 2.13.0, CPU build (about a minute the first time)" pip_install "torch==2.13.0"
extras="dev"
if [ "$with_fleet" -eq 1 ]; then extras="dev,fleet"; fi
step 3 "$total" "kvyard and its dependencies ($extras), editable" pip_install -e ".[$extras]"
if [ "$with_tests" -eq 1 ]; then
    step 4 "$total" "redis-server through apt, for the KV-tier tests" install_redis
fi
echo "setup: ready. Commands: .venv/bin/kvyard --help"

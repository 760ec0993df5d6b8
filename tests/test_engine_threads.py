"""`kvyard serve` gives its CPU threads to the engine's thread alone (kvyard.kernels.threads): every other thread
computes with one OpenMP thread, so the process never holds two full OpenMP teams. Each case runs in a fresh
interpreter, since the reservation must come before PyTorch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvyard.kernels.threads import ENGINE_THREADS_VARIABLE, physical_cores

PROBE = """
import json, threading
from kvyard.kernels.threads import engine_threads, reserve_threads_for_engine, use_engine_threads
reserved = reserve_threads_for_engine()
import torch
from kvyard.kernels.ops import load_native_kernels
seen = {"reserved": reserved, "kept": engine_threads(), "main": torch.get_num_threads()}
def loader():
    seen["kernels"] = load_native_kernels().decode_layer.num_threads  # bound before the engine thread runs
    use_engine_threads()
    seen["engine"] = torch.get_num_threads()
thread = threading.Thread(target=loader)
thread.start()
thread.join()
print(json.dumps(seen))
"""

ALREADY_IMPORTED = """
import json, os, torch
from kvyard.kernels.threads import reserve_threads_for_engine
print(json.dumps({"reserved": reserve_threads_for_engine(), "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


def probe(code: str, **env: str) -> dict[str, object]:
    environment = {
        key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", ENGINE_THREADS_VARIABLE)
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    answer: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return answer


def test_the_engine_thread_alone_computes_with_one_thread_per_physical_core() -> None:
    seen = probe(PROBE)
    cores = physical_cores()
    assert seen == {"reserved": cores, "kept": cores, "main": 1, "kernels": cores, "engine": cores}


def test_the_users_omp_num_threads_becomes_the_engines_count() -> None:
    seen = probe(PROBE, OMP_NUM_THREADS="3")
    assert seen == {"reserved": 3, "kept": 3, "main": 1, "kernels": 3, "engine": 3}


def test_a_server_started_by_a_server_keeps_the_first_count() -> None:
    """A replica a deploy or a test starts from a served process inherits OMP_NUM_THREADS=1 and the count."""
    seen = probe(PROBE, OMP_NUM_THREADS="1", **{ENGINE_THREADS_VARIABLE: "2"})
    assert seen["reserved"] == 2 and seen["engine"] == 2 and seen["main"] == 1


def test_nothing_changes_where_pytorch_is_already_imported() -> None:
    assert probe(ALREADY_IMPORTED) == {"reserved": None, "omp": None}

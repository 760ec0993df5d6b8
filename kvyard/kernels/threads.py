"""How many CPU threads a served engine computes with, and that only the engine's thread computes with them.

OpenMP (GNU libgomp, which PyTorch and the native kernels share) keeps a team of worker threads for every thread
that has run a parallel region, and once it manages more threads than there are CPUs it stops spinning between
regions: every region then waits for its workers to be woken (two context switches, tens of microseconds in a
VM). Importing PyTorch runs a parallel region on the importing thread; a server whose engine then computes on
its own thread had two full teams, and its matmuls ran 1.5-3x slower than the same matmuls on the main thread.

So `kvyard serve` reserves the cores before PyTorch or the kernels load OpenMP: every thread starts with one
OpenMP thread (`OMP_NUM_THREADS=1`), and only the threads that load or run the engine take the engine's count,
which is kept in `KVYARD_ENGINE_THREADS` (the user's `OMP_NUM_THREADS` if they set one, else one thread per
physical core this process may run on, as PyTorch's default). Offline use (`LLM`, `kvyard generate`) computes
on the calling thread and needs none of this.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENGINE_THREADS_VARIABLE = "KVYARD_ENGINE_THREADS"


def reserve_threads_for_engine() -> int | None:
    """Before PyTorch or the kernels are imported: one OpenMP thread for every thread, the engine's count kept
    for `engine_threads`; returns that count (None, changing nothing, where PyTorch is already imported: its
    threads are set). A second call (a child process of a server) keeps the first's count."""
    if "torch" in sys.modules:
        return None
    count = engine_threads() or _positive_int(os.environ.get("OMP_NUM_THREADS")) or physical_cores()
    os.environ[ENGINE_THREADS_VARIABLE] = str(count)
    os.environ["OMP_NUM_THREADS"] = "1"
    return count


def engine_threads() -> int | None:
    """The count `reserve_threads_for_engine` kept (None: it was not called in this process or its parents)."""
    return _positive_int(os.environ.get(ENGINE_THREADS_VARIABLE))


def use_engine_threads() -> None:
    """On a thread that loads or runs the PyTorch engine: let PyTorch compute with the engine's threads (nothing
    where they were not reserved)."""
    count = engine_threads()
    if count is None:
        return
    import torch  # only engines that already loaded PyTorch call this

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (each counted once however many hyperthreads)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = {_core_of(cpu) for cpu in cpus}
    return max(1, len(cores))


def _core_of(cpu: int) -> tuple[str, str] | int:
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:
        return cpu  # no topology (a container that hides it): count the CPU as a core


def _positive_int(value: str | None) -> int | None:
    try:
        number = int(value) if value else 0
    except ValueError:
        return None
    return number if number > 0 else None

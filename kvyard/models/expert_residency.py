"""Experts kept out of memory: a mixture-of-experts model whose routed experts' weights stay in its weight package
on disk, at most a budget of them resident, read when a token picks them.

Which experts stay: the ones used most, recently. Each expert's use count decays by half every `half_life_uses`
expert uses, and the expert with the lowest decayed count is the one dropped (a router whose picks are skewed
keeps its popular experts; a uniform one degrades towards least recently used). The order is kept in a heap
without ever rescaling the counts: log2(count at t) + t / half_life does not change as t moves on.

When they are read: a layer's router names its experts before any of them runs, so all but the first are read
by a reader thread while the first is read here and the others compute; and the next expert layer's router,
applied early to this layer's input, names the experts that layer will probably want, read ahead on the same
thread. A prefetch never drops an expert the running layer wants, one still being read, or one read ahead and
not used yet; a read the layer needs now may drop anything but the expert it is about to run.

Experts live in one pool of equal slots allocated once (the budget's worth, its pages touched as slots fill), read
by plain `preadv` calls, after which the file's pages are dropped from the page cache: the resident set is what the
budget says, not that plus a second copy the kernel keeps, nor memory freed to the allocator and kept there. The
forward thread owns every decision (what is resident, which slot, what a module points at); the reader thread only
fills slots it is given.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kvyard.models.mapped_safetensors import TensorExtent

_LOG = logging.getLogger(__name__)
LOG_INTERVAL_S = 60.0  # the serve log's line on the cache, at most this often while experts are used
LOG_CHECK_USES = 1024  # uses between looks at the clock
SLOT_ALIGNMENT = 64

FILE_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
}


@dataclass(frozen=True, slots=True)
class PagedTensor:
    """One weight of an expert: the module attribute that holds it while resident, and where its bytes lie."""

    holder: nn.Module
    attribute: str
    extent: TensorExtent


@dataclass(slots=True)
class _Expert:
    key: tuple[int, int]  # (layer, expert)
    tensors: tuple[PagedTensor, ...]
    nbytes: int
    buffers: list[torch.Tensor] | None = None  # resident: views of its slot
    slot: int = -1  # its place in the pool while resident or being read
    loading: Future[tuple[list[torch.Tensor], float]] | None = None  # (buffers, seconds read)
    read_ahead: bool = False  # resident by a prefetch, not used since
    priority: float = -math.inf  # log2(decayed use count) + uses at its last update / half life
    version: int = 0  # heap entries with another version are stale


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    """The expert cache's state and counters since the model loaded."""

    budget_bytes: int
    resident_bytes: int
    resident_experts: int
    experts: int
    hits: int  # uses that found the expert resident (read ahead or kept)
    misses: int  # uses that had to read it then
    prefetch_hits: int  # hits on experts read ahead (being read counts: the wait is shorter)
    late_prefetches: int  # hits that waited for their read ahead to finish
    prefetches: int  # experts read ahead
    evictions: int
    read_bytes: int
    read_seconds: float  # spent reading, in either thread
    wait_seconds: float  # the forward thread's time waiting for reads


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0
    late_prefetches: int = 0
    prefetches: int = 0
    evictions: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass(slots=True)
class _Order:
    """Experts by decayed use count, lowest first (a heap with stale entries skipped)."""

    half_life_uses: float
    uses: int = 0
    heap: list[tuple[float, int, tuple[int, int]]] = field(default_factory=list)

    def used(self, expert: _Expert) -> None:
        self.uses += 1
        now = self.uses / self.half_life_uses
        count = 2.0 ** (expert.priority - now) if expert.priority > -math.inf else 0.0
        self.push(expert, math.log2(count + 1.0) + now)

    def compact(self, resident: Iterable[_Expert]) -> None:
        """Only the live entry of each resident expert: a use pushes an entry and leaves the old one to go stale,
        which only evictions would otherwise clear."""
        self.heap = [(e.priority, e.version, e.key) for e in resident]
        heapq.heapify(self.heap)

    def push(self, expert: _Expert, priority: float) -> None:
        expert.priority = priority
        expert.version += 1
        heapq.heappush(self.heap, (priority, expert.version, expert.key))


class ExpertResidency:
    """The routed experts of a model's expert layers, resident within `budget_bytes` (see the module's text)."""

    def __init__(
        self,
        path: Path,
        experts: dict[tuple[int, int], tuple[PagedTensor, ...]],
        budget_bytes: int,
        half_life_uses: float,
    ) -> None:
        self._experts = {
            key: _Expert(key, tensors, sum(t.extent.nbytes for t in tensors)) for key, tensors in experts.items()
        }
        # One pool of equal slots, allocated once: buffers allocated and freed per read would leave freed memory
        # with the allocator (measured: 0.3 GB above the budget after 3 GB of reads), outside any budget.
        self._slot_bytes = max(_slot_layout(e.tensors)[1] for e in self._experts.values())
        slots = budget_bytes // self._slot_bytes
        if slots < 2:
            raise ValueError(
                f"an expert budget of {budget_bytes} bytes cannot hold two experts of {self._slot_bytes} bytes"
            )
        self._pool = torch.empty(slots * self._slot_bytes, dtype=torch.uint8)  # pages touched as slots fill
        self._free_slots = list(range(slots - 1, -1, -1))
        self.budget_bytes = budget_bytes
        self._fd = os.open(path, os.O_RDONLY)
        # Closed by close(), or when the residency is collected (a load that fails after it was made).
        self._close_file = weakref.finalize(self, os.close, self._fd)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvyard-expert-reader")
        self._order = _Order(half_life_uses)
        self._resident_bytes = 0  # resident and being read
        self._wanted: set[tuple[int, int]] = set()  # the running layer's experts
        self._soon: set[tuple[int, int]] = set()  # read ahead for the next layer
        self._counters = _Counters()
        self._logged_at = time.monotonic()
        self._logged = self.snapshot()
        for tensors in experts.values():
            for tensor in tensors:
                _bind(tensor, _placeholder(tensor))

    # ------------------------------------------------------------------ forward thread

    def fill(self) -> int:
        """Read experts into every free slot, in the file's order (long sequential reads), so that the cache is warm
        from the first token, as a memory-mapped engine's pages are once populated at load; returns how many. They
        count as never used: the first to be dropped."""
        filled = 0
        for expert in sorted(self._experts.values(), key=lambda e: e.tensors[0].extent.offset):
            if not self._free_slots:
                break
            self._make_room(expert, for_prefetch=True)
            expert.buffers, seconds = self._timed_read(expert)
            self._counted_read(expert, seconds)
            self._order.push(expert, -math.inf)
            filled += 1
        return filled

    def want(self, layer: int, experts: list[int]) -> None:
        """The running layer's experts, in the order it will use them: the second and later are read ahead now."""
        self._wanted = {(layer, expert) for expert in experts}
        self._soon = set()
        self.prefetch(layer, experts[1:])

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Read these experts on the reader thread where that drops nothing anyone is about to use."""
        for number in experts:
            expert = self._experts[(layer, number)]
            self._soon.add(expert.key)
            if expert.buffers is not None or expert.loading is not None:
                continue
            if not self._make_room(expert, for_prefetch=True):
                return
            expert.loading = self._reader.submit(self._timed_read, expert)
            expert.read_ahead = True
            self._counters.prefetches += 1
            if expert.priority == -math.inf:  # never used: half a use, now
                self._order.push(expert, self._order.uses / self._order.half_life_uses - 1.0)
            else:
                self._order.push(expert, expert.priority)

    def use(self, layer: int, number: int) -> None:
        """Make expert `number` of `layer` resident and point its modules at its weights, reading it if needed."""
        expert = self._experts[(layer, number)]
        if expert.buffers is None and expert.loading is None:
            self._counters.misses += 1
            self._make_room(expert, for_prefetch=False)
            try:
                buffers, seconds = self._timed_read(expert)
            except BaseException:
                self._release(expert)
                raise
            expert.buffers = buffers
            self._counted_read(expert, seconds)
            self._counters.wait_seconds += seconds
        else:
            self._counters.hits += 1
            self._counters.prefetch_hits += expert.read_ahead
            if expert.loading is not None:
                self._counters.late_prefetches += not expert.loading.done()
                error = self._settle(expert)
                if error is not None:
                    raise error
        expert.read_ahead = False
        self._order.used(expert)  # once resident: a heap entry of an expert not resident is dropped as stale
        if len(self._order.heap) > 2 * len(self._experts) + 64:
            self._order.compact(e for e in self._experts.values() if e.buffers is not None or e.loading is not None)
        if self._order.uses % LOG_CHECK_USES == 0:
            self._log_progress()
        assert expert.buffers is not None
        for tensor, buffer in zip(expert.tensors, expert.buffers):
            _bind(tensor, buffer)

    def _log_progress(self) -> None:
        """At most once a LOG_INTERVAL_S: the cache's state and its hit ratio since the last line (the serve log)."""
        now = time.monotonic()
        if now - self._logged_at < LOG_INTERVAL_S:
            return
        snap, last = self.snapshot(), self._logged
        uses = snap.hits + snap.misses - last.hits - last.misses
        _LOG.info(
            "experts: %d of %d resident (%.2f of %.2f GB); last %.0f s: %d uses, hit ratio %.3f, %.2f GB read in "
            "%.1f s, the forward pass waited %.1f s",
            snap.resident_experts,
            snap.experts,
            snap.resident_bytes / 1024**3,
            snap.budget_bytes / 1024**3,
            now - self._logged_at,
            uses,
            (snap.hits - last.hits) / uses if uses else 0.0,
            (snap.read_bytes - last.read_bytes) / 1024**3,
            snap.read_seconds - last.read_seconds,
            snap.wait_seconds - last.wait_seconds,
        )
        self._logged_at, self._logged = now, snap

    def holders(self) -> frozenset[int]:
        """The ids of the modules whose weights this residency swaps in and out."""
        return frozenset(id(t.holder) for e in self._experts.values() for t in e.tensors)

    def snapshot(self) -> ResidencySnapshot:
        c = self._counters
        resident = sum(1 for e in self._experts.values() if e.buffers is not None)
        return ResidencySnapshot(
            self.budget_bytes,
            self._resident_bytes,
            resident,
            len(self._experts),
            c.hits,
            c.misses,
            c.prefetch_hits,
            c.late_prefetches,
            c.prefetches,
            c.evictions,
            c.read_bytes,
            c.read_seconds,
            c.wait_seconds,
        )

    def close(self) -> None:
        """Stop the reader and close the file (once; a residency never closed closes it when collected)."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._close_file()

    def _settle(self, expert: _Expert) -> BaseException | None:
        """Wait for the expert's read ahead: it is then resident, or, if the read failed, not (its slot freed) and
        the error returned, so that a use of this expert raises it and no other caller does."""
        assert expert.loading is not None
        start = time.perf_counter()
        error = expert.loading.exception()
        self._counters.wait_seconds += time.perf_counter() - start
        if error is not None:
            self._release(expert)
            return error
        expert.buffers, seconds = expert.loading.result()
        self._counted_read(expert, seconds)
        expert.loading = None
        return None

    def _release(self, expert: _Expert) -> None:
        """Give back the slot of a read that failed: the expert is not resident."""
        expert.loading = None
        expert.read_ahead = False
        expert.version += 1
        self._free_slots.append(expert.slot)
        expert.slot = -1
        self._resident_bytes -= expert.nbytes

    def _counted_read(self, expert: _Expert, seconds: float) -> None:
        self._counters.read_seconds += seconds
        self._counters.read_bytes += expert.nbytes

    def _make_room(self, expert: _Expert, for_prefetch: bool) -> bool:
        """Count `expert` as resident, dropping others until it fits; False when a prefetch cannot fit without
        dropping what is about to be used."""
        while not self._free_slots:
            victim = self._next_victim(expert, self._wanted | self._soon)
            if victim is None and not for_prefetch:
                victim = self._next_victim(expert, self._wanted) or self._next_victim(expert, set())
            if victim is not None:
                self._evict(victim)
            elif for_prefetch:
                return False
            elif not self._wait_for_a_read(expert):
                raise RuntimeError(f"no expert can make room for {expert.key} within {self.budget_bytes} bytes")
        expert.slot = self._free_slots.pop()
        self._resident_bytes += expert.nbytes
        return True

    def _next_victim(self, expert: _Expert, kept: set[tuple[int, int]]) -> _Expert | None:
        """The least used resident expert other than `expert`, one being read, or those in `kept`."""
        heap = self._order.heap
        skipped: list[tuple[float, int, tuple[int, int]]] = []
        victim = None
        while heap:
            entry = heapq.heappop(heap)
            candidate = self._experts[entry[2]]
            if candidate.loading is not None and candidate.loading.done():
                self._settle(candidate)  # read ahead and never used yet: droppable like any resident expert
            if entry[1] != candidate.version or (candidate.buffers is None and candidate.loading is None):
                continue  # stale, or not resident: no entry needed
            if candidate is expert or candidate.loading is not None or candidate.key in kept:
                skipped.append(entry)
                continue
            victim = candidate
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return victim

    def _wait_for_a_read(self, expert: _Expert) -> bool:
        """Finish one read ahead (it becomes droppable); False when none is under way."""
        for other in self._experts.values():
            if other.loading is not None and other is not expert:
                self._settle(other)  # a failed read frees its slot too
                return True
        return False

    def _evict(self, victim: _Expert) -> None:
        victim.buffers = None
        victim.read_ahead = False
        victim.version += 1  # its heap entry goes stale; a later use or prefetch pushes a new one
        for tensor in victim.tensors:
            _bind(tensor, _placeholder(tensor))
        self._free_slots.append(victim.slot)
        victim.slot = -1
        self._resident_bytes -= victim.nbytes
        self._counters.evictions += 1

    # ------------------------------------------------------------------ either thread

    def _timed_read(self, expert: _Expert) -> tuple[list[torch.Tensor], float]:
        """The expert's tensors read into its slot (reserved for this read by the forward thread)."""
        start = time.perf_counter()
        base = expert.slot * self._slot_bytes
        offsets = _slot_layout(expert.tensors)[0]
        buffers = [
            _read_tensor(self._fd, tensor.extent, self._pool[base + offset : base + offset + tensor.extent.nbytes])
            for tensor, offset in zip(expert.tensors, offsets)
        ]
        return buffers, time.perf_counter() - start


def _slot_layout(tensors: tuple[PagedTensor, ...]) -> tuple[list[int], int]:
    """Each tensor's offset in a slot (64-byte aligned, so every dtype may view it) and the slot's size."""
    offsets, size = [], 0
    for tensor in tensors:
        offsets.append(size)
        size += -(-tensor.extent.nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    return offsets, size


def _read_tensor(fd: int, extent: TensorExtent, region: torch.Tensor) -> torch.Tensor:
    """`extent`'s bytes read into `region` (uint8), returned as the tensor they are."""
    view = memoryview(region.numpy().data)
    done = 0
    while done < extent.nbytes:
        count = os.preadv(fd, [view[done:]], extent.offset + done)
        if count == 0:
            raise OSError(f"the weight file ended {extent.nbytes - done} bytes into a tensor")
        done += count
    # The bytes are ours now; the kernel's copy would only double what the budget counts.
    os.posix_fadvise(fd, extent.offset, extent.nbytes, os.POSIX_FADV_DONTNEED)
    return region.view(FILE_DTYPES[extent.dtype]).view(extent.shape)


def _placeholder(tensor: PagedTensor) -> torch.Tensor:
    """What an expert's module holds while it is not resident: empty, so a use without `use()` fails loudly."""
    return torch.empty(0, dtype=FILE_DTYPES[tensor.extent.dtype])


def _bind(tensor: PagedTensor, value: torch.Tensor) -> None:
    getattr(tensor.holder, tensor.attribute).data = value

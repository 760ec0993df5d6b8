"""Per-request view of the block pool: prefix-cache lookup, slot allocation, block registration.

Blocks the device cache lacks but a lower tier may hold, or (for a request prefilled on another replica) that
replica holds, are loaded off the engine thread: the first time a waiting request is considered, its load
starts; the request is admitted once the load has finished (or gave up at its deadline), and running requests
keep stepping meanwhile. A load that finishes within `LOAD_WAIT_IN_STEP_S` (host memory, a quick miss) is
used in the same step. Whatever a load did not bring, the request computes itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, wait
from typing import Any, Protocol

from kvyard.engine.blend.segments import SegmentIndex, SegmentMatch
from kvyard.engine.scheduling.block_pool import BlockPool
from kvyard.engine.scheduling.request import BlockSource, Request, TierLoad
from kvyard.kvcache.events import KVEventLog
from kvyard.kvcache.pd_stream import TransferHandle
from kvyard.kvcache.segment_key import root_mix, window_hash

_LOG = logging.getLogger(__name__)
LOAD_WAIT_IN_STEP_S = 0.005


class BlockTier(BlockSource, Protocol):
    """A lower KV tier below the device pool (see kv_tier_link.KVTierLink)."""

    load_deadline_s: float  # a load gives up this long after it was asked for, unless it keeps bringing blocks
    compute_s_per_block: float  # what computing a block costs here now (the engine keeps it current; 0: unknown)

    @property
    def extension_s_per_block(self) -> float:
        """How much each block a load brings pushes its deadline back."""
        ...

    def start_fetch(self, root_key: bytes, keys: Sequence[bytes]) -> Future[Sequence[Any]]:
        """Load the longest available prefix of `keys` on another thread."""
        ...

    def offload(self, root_key: bytes, keys: Sequence[bytes], block_ids: Sequence[int]) -> None: ...

    def publish_events(self, events: KVEventLog | None) -> None:
        """Record what the tiers gain and lose in `events` (docs/contracts.md §7)."""
        ...

    def local_keys(self) -> list[bytes]:
        """Every block the replica's own tiers hold."""
        ...

    def shared_store(self) -> tuple[str, float | None] | None:
        """The shared store's id and block TTL (None: no shared tier, or not reached yet)."""
        ...

    def shared_available(self) -> bool: ...

    def load_totals(self) -> dict[str, tuple[float, int]]:
        """Seconds spent loading and blocks served so far, by medium (`local`, `shared`)."""
        ...


class BlockPuller(BlockSource, Protocol):
    """Pulls the blocks of a request prefilled on another replica (see kv_pull_link.KVPullLink)."""

    def start_pull(
        self,
        handle: TransferHandle,
        root_key: bytes,
        keys: Sequence[bytes],
        first_block: int,
        block_ids: Sequence[int] | None = None,
    ) -> Future[Sequence[Any]]:
        """Pull blocks `first_block`, ... of the transfer (whose keys are `keys`) on another thread, writing each
        verified block into `block_ids` as it arrives (None: the caller installs them)."""
        ...

    def pulling(self, handle: TransferHandle) -> bool:
        """A pull of this transfer is running (choices of one request share it)."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """Let the prefill side unpin the transfer's blocks without pulling them."""
        ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, tier: BlockTier | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tier = tier
        self.puller: BlockPuller | None = None
        # Thread-driven engines wait this long for a load that may finish at once; an engine stepped on an
        # event loop (the simulator) sets 0 and never blocks.
        self.load_wait_s = LOAD_WAIT_IN_STEP_S
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0
        self.num_tier_hit_tokens = 0  # of those, loaded from the lower tier
        self.num_shared_hit_tokens = 0  # of those, from the shared store
        self.num_pulled_tokens = 0  # of those, pulled from a prefill replica
        self._orphaned: list[TierLoad] = []  # loads of requests that ended, holding reserved blocks
        self.segments: SegmentIndex | None = None  # computed blocks by their own tokens (enable_segments)

    def enable_segments(self) -> None:
        """Index every computed block by its tokens too, for prompts whose prefix broke (blending)."""
        if self.pool.enable_caching and self.segments is None:
            self.segments = SegmentIndex(self.block_size)
            self.pool.on_evict = self.segments.discard

    def find_segments(self, request: Request, start: int) -> list[SegmentMatch]:
        """Cached blocks holding `request`'s tokens after position `start`, wherever they were computed."""
        if self.segments is None:
            return []
        return self.segments.find(request.all_token_ids, start, request.cache_root_key)

    def ready_to_admit(self, request: Request) -> bool:
        """False while blocks of `request` are being loaded; the first call starts the load."""
        if not self.pool.enable_caching or request.tier_checked:
            return True
        if request.tier_load is None:
            max_blocks = self._max_cached_blocks(request)
            device_blocks = self._device_prefix(request, max_blocks)
            load = self._start_load(request, device_blocks, max_blocks)
            if load is None:
                request.tier_checked = True
                return True
            request.tier_load = load
            if self.load_wait_s > 0:
                wait([load.future], timeout=self.load_wait_s)
        return request.tier_load.future.done()

    def _start_load(self, request: Request, device_blocks: list[int], max_blocks: int) -> TierLoad | None:
        """Pull from the prefill replica when the request was prefilled elsewhere (once: after a preemption its
        blocks are in the device cache or gone), else look in the lower tier."""
        first_block = len(device_blocks)
        keys = request.block_keys[first_block:max_blocks]
        transfer = request.kv_transfer
        if self.puller is not None and transfer is not None and transfer.pull_from is not None:
            request.kv_transfer = None
            if not keys:  # the device cache has it all: only let the prefill side go
                self.puller.release(transfer.pull_from)
                return None
            return self._start_pull(self.puller, request, transfer.pull_from, device_blocks, keys)
        if self.tier is not None and keys:
            return TierLoad(first_block, self.tier.start_fetch(request.cache_root_key, keys), self.tier)
        return None

    def _start_pull(
        self,
        puller: BlockPuller,
        request: Request,
        handle: TransferHandle,
        device_blocks: list[int],
        keys: list[bytes],
    ) -> TierLoad:
        """Reserve device blocks for what the pull brings, so the puller writes each block in place as it arrives
        (off the engine thread: no step stalls copying a long prompt's KV at admission)."""
        first_block = len(device_blocks)
        if puller.pulling(handle):  # another choice's pull: its blocks are installed at admission
            return TierLoad(first_block, puller.start_pull(handle, request.cache_root_key, keys, first_block), puller)
        self.pool.touch(device_blocks)  # reserving must not evict the prefix the pulled blocks continue
        try:
            reserved = self.pool.allocate(min(len(keys), self.pool.num_free_blocks))
        finally:
            self.pool.free(reversed(device_blocks))
        future = puller.start_pull(handle, request.cache_root_key, keys[: len(reserved)], first_block, reserved)
        return TierLoad(first_block, future, puller, reserved)

    def settle_written_pulls(self, requests: Iterable[Request]) -> None:
        """Blocks that a finished pull wrote in place enter the prefix cache now, unreferenced, instead of staying
        pinned until their request is admitted: waiting requests whose pinned blocks filled the pool would leave
        none for the request at the head of the queue (a stall nothing ends). Each finds its blocks at admission
        as device hits, unless the pool needed them first (then it computes them)."""
        for request in requests:
            load = request.tier_load
            if load is None or load.block_ids is None or not load.future.done():
                continue
            request.tier_load, request.tier_checked = None, True
            max_blocks = self._max_cached_blocks(request)
            self._install_loaded(request, self._device_prefix(request, max_blocks), max_blocks, load)

    def drop_load(self, request: Request) -> None:
        """The request ends while its load runs: blocks reserved for it are freed once the load is done."""
        load, request.tier_load = request.tier_load, None
        if load is not None and load.block_ids:
            self._orphaned.append(load)

    def reap_orphaned_loads(self) -> None:
        """Free the reserved blocks of loads whose request went away, once nothing writes into them."""
        done = [load for load in self._orphaned if load.future.done()]
        for load in done:
            self._orphaned.remove(load)
            assert load.block_ids is not None
            self.pool.free(reversed(load.block_ids))

    def wait_for_loads(self, requests: Iterable[Request], timeout: float) -> None:
        """Block until one of the tier loads of `requests` finishes, at most `timeout` s (nothing else to do)."""
        futures = [r.tier_load.future for r in requests if r.tier_load is not None]
        if futures and timeout > 0:
            wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix, including blocks a finished tier load brought; the last
        token is always left to compute, since its logits are needed to sample."""
        if not self.pool.enable_caching:
            return []
        max_blocks = self._max_cached_blocks(request)
        blocks = self._device_prefix(request, max_blocks)
        load, request.tier_load = request.tier_load, None
        if load is not None:
            request.tier_checked = True
            blocks.extend(self._install_loaded(request, blocks, max_blocks, load))
        return blocks

    def num_cached_tokens_estimate(self, request: Request) -> int:
        """Prompt tokens the device cache, and a load that has finished, would give `request` now; nothing is taken
        or installed (find_cached_prefix does that at admission)."""
        if not self.pool.enable_caching:
            return 0
        max_blocks = self._max_cached_blocks(request)
        num_blocks = len(self._device_prefix(request, max_blocks))
        load = request.tier_load
        if load is not None and load.future.done() and load.future.exception() is None:
            num_blocks = max(num_blocks, min(max_blocks, load.first_block + len(load.future.result())))
        return num_blocks * self.block_size

    def _max_cached_blocks(self, request: Request) -> int:
        if request.computes_whole_prompt:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def _device_prefix(self, request: Request, max_blocks: int) -> list[int]:
        blocks: list[int] = []
        for key in request.block_keys[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def _install_loaded(self, request: Request, device_blocks: list[int], max_blocks: int, load: TierLoad) -> list[int]:
        """Continue a device-cache prefix with loaded blocks, in newly allocated, registered blocks.

        They are left unreferenced but cached, exactly like device hits, for allocate_slots to take."""
        try:
            fetched = load.future.result()
        except Exception:  # the source reports its own faults; a load that raised is a miss
            _LOG.exception("loading KV blocks failed")
            if load.block_ids:
                self.pool.free(reversed(load.block_ids))
            return []
        if load.block_ids is not None:
            return self._adopt_written(request, device_blocks, max_blocks, load, fetched)
        skip = len(device_blocks) - load.first_block  # blocks the device cache gained since the load began
        if skip < 0:
            return []  # the device cache lost blocks before the loaded ones: they no longer continue it
        num_local = getattr(fetched, "num_local", len(fetched)) - skip  # from the replica's own tiers, not shared
        fetched = fetched[skip : skip + max_blocks - len(device_blocks)]
        self.pool.touch(device_blocks)  # so allocating for the loaded blocks cannot evict them
        loaded: list[int] = []
        try:
            fetched = fetched[: self.pool.num_free_blocks]
            keys = request.block_keys[len(device_blocks) : len(device_blocks) + len(fetched)]
            loaded = self.pool.allocate(len(fetched))
            load.source.install(loaded, fetched)
            self.pool.register_blocks(loaded, keys)
        finally:
            self.pool.free(reversed(device_blocks + loaded))
        if load.source is self.tier:
            self._count_tier_hits(request, len(loaded), max(0, min(num_local, len(loaded))))
        else:
            self.num_pulled_tokens += len(loaded) * self.block_size
        self._set_source_cached(request, fetched, len(device_blocks) + len(loaded))
        return loaded

    def _adopt_written(
        self, request: Request, device_blocks: list[int], max_blocks: int, load: TierLoad, fetched: Sequence[Any]
    ) -> list[int]:
        """Like `_install_loaded`, for blocks the source already wrote into the reserved `load.block_ids`: register
        those that continue the device prefix, free all reservations (the registered ones stay cached)."""
        reserved = load.block_ids or []
        skip = len(device_blocks) - load.first_block
        adopted: list[int] = []
        if skip >= 0:
            adopted = reserved[skip : min(len(fetched), skip + max_blocks - len(device_blocks))]
            keys = request.block_keys[len(device_blocks) : len(device_blocks) + len(adopted)]
            registered = {block for block, _ in self.pool.register_blocks(adopted, keys)}
            adopted = adopted[: next((i for i, b in enumerate(adopted) if b not in registered), len(adopted))]
        self.pool.free(reversed(reserved))
        self.num_pulled_tokens += len(adopted) * self.block_size
        self._set_source_cached(request, fetched, len(device_blocks) + len(adopted))
        return adopted

    def _count_tier_hits(self, request: Request, num_loaded: int, num_local: int) -> None:
        shared_tokens = (num_loaded - num_local) * self.block_size
        self.num_tier_hit_tokens += num_loaded * self.block_size
        self.num_shared_hit_tokens += shared_tokens
        if request.num_cached_tokens < 0:  # its first admission: what the usage reports
            request.num_local_tier_tokens = num_local * self.block_size
            request.num_shared_tier_tokens = shared_tokens

    def _set_source_cached(self, request: Request, fetched: Sequence[Any], num_blocks: int) -> None:
        source_cached_tokens: int | None = getattr(fetched, "source_cached_tokens", None)
        if source_cached_tokens is not None and request.num_cached_tokens < 0:
            # Pulled blocks were computed, on the prefill side: only what it had cached was computed nowhere.
            request.num_cached_tokens = min(source_cached_tokens, num_blocks * self.block_size)

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens after its computed (and newly
        cached) ones. Returns False, changing nothing, when the pool cannot supply them."""
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        blocks_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, blocks_needed - len(request.block_table) - len(cached_blocks))
        if not num_new_blocks and not cached_blocks:  # a decode step inside its last block: nothing to do
            return True
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_table.extend(cached_blocks)
            request.num_registered_blocks = len(request.block_table)
        request.block_table.extend(self.pool.allocate(num_new_blocks))
        return True

    def register_computed_blocks(self, request: Request) -> None:
        """Enter every full, computed block of `request` into the prefix cache (and the segment index); blocks
        from `request.exact_until` on hold blended, approximate keys and values and are never entered."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_keys))
        if request.exact_until is not None:
            num_full = min(num_full, request.exact_until // self.block_size)
        start = request.num_registered_blocks
        if num_full <= start:
            return
        rolling: list[int] = []
        fingerprints = None
        if self.segments is not None:  # announced with the keys, for a router to find moved text by
            size, tokens = self.block_size, request.all_token_ids
            firsts = range(start * size, num_full * size, size)
            rolling = [window_hash(tokens[first : first + size]) for first in firsts]
            mix = root_mix(request.cache_root_key)
            fingerprints = [value ^ mix for value in rolling]
        registered = self.pool.register_blocks(
            request.block_table[start:num_full], request.block_keys[start:num_full], fingerprints
        )
        request.num_registered_blocks = num_full
        if self.segments is not None and registered:
            newly = {block_id for block_id, _ in registered}
            _index_segments(self.segments, request, range(start, num_full), newly, rolling)
        if self.tier is not None and registered:
            self.tier.offload(request.cache_root_key, [key for _, key in registered], [b for b, _ in registered])

    def free(self, request: Request) -> None:
        self.drop_load(request)
        # Tail blocks first, so they are evicted before the shared-prefix blocks.
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        request.num_registered_blocks = 0


def _index_segments(
    segments: SegmentIndex, request: Request, numbers: range, registered: set[int], rolling: list[int]
) -> None:
    """Add the request's blocks `numbers` that were newly registered to the segment index (`rolling`: each
    block's window hash, computed once for its fingerprint)."""
    size = segments.block_size
    for offset, number in enumerate(numbers):
        block_id = request.block_table[number]
        if block_id in registered:
            tokens = request.all_token_ids[number * size : (number + 1) * size]
            segments.add(block_id, number * size, tokens, request.cache_root_key, rolling[offset])

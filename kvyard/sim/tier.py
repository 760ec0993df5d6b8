"""The KV tier below a simulated replica's device cache: the real tier stack holding stand-in blocks, each load
charged the time the simulated model's KV would take to load.

Each replica gets `kvyard serve`'s own `KVTierLink` and `TieredStore`, over a `MemoryTier` of its own (the host
tier) and a view of one `MemoryTier` that every replica of the process shares (the shared store, standing in for
Redis). Blocks are written when they are registered and looked up at admission by the engine's own code, so the
contiguous-prefix rule, promotion into the host tier and verification are the real ones. The blocks are
`transfer.STAND_IN_FORMAT` payloads of a few bytes; tier capacities count them in blocks.

`ModeledTierLink` only changes when a load finishes: each tier that was asked costs its latency plus the modeled
bytes of the blocks it served over its bandwidth; blocks that would arrive after the load deadline are dropped,
as the real store stops at its deadline; loads of one replica follow each other, as on the real link's one loader
thread. The load's future completes that many simulated seconds (times `time_scale`) after it began, on a timer
thread, so the event loop never waits.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvyard.engine.kv_links.tier_link import KVTierLink
from kvyard.kvcache.codec import HEADER_BYTES, Blob, DecodedBlock
from kvyard.kvcache.memory_tier import MemoryTier
from kvyard.kvcache.stats import StoreSnapshot, TierStats
from kvyard.kvcache.tier import LoadDeadline, PutResult, Tier
from kvyard.kvcache.tiered_store import LoadedBlocks, TieredStore
from kvyard.sim.config import SimConfig
from kvyard.sim.modeled_pulls import STAND_IN_FORMAT, StandInBlocks

STAND_IN_BLOB_BYTES = HEADER_BYTES + STAND_IN_FORMAT.num_elements  # one encoded stand-in block (uint8 payload)
HOST, SHARED = "host", "shared"


class TierStandInBlocks:
    """The simulator's device blocks as the tier link copies them: stand-ins, read as one memoryview each."""

    format = STAND_IN_FORMAT

    def __init__(self) -> None:
        self.blocks = StandInBlocks()

    def read(self, block_ids: Sequence[int]) -> list[memoryview]:
        return [memoryview(row) for row in self.blocks.read(block_ids)]

    def write(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None:
        self.blocks.write(block_ids, blocks)


class SharedStoreView:
    """One replica's handle on the process's shared store: the replica's own counters, and closing it leaves the
    store (which outlives the replica's restarts) as it is."""

    name = SHARED
    shared = True
    ttl_s: float | None = None

    def __init__(self, store: MemoryTier) -> None:
        self.store = store
        self.stats = TierStats()

    @property
    def store_id(self) -> str | None:
        return self.store.store_id

    @property
    def num_blocks(self) -> int:
        return len(self.store)

    def keys(self) -> list[bytes]:
        return []

    def get_prefix(self, keys: Sequence[bytes], deadline: LoadDeadline | float) -> Sequence[Blob]:
        start = time.perf_counter()
        found = self.store.get_prefix(keys, deadline)
        self.stats.add(loads=1, load_seconds=time.perf_counter() - start, bytes_read=sum(map(len, found)))
        return found

    def contains(self, key: bytes) -> bool:
        return self.store.contains(key)

    def put_many(self, items: Sequence[tuple[bytes, Blob]]) -> PutResult:
        """What this replica's write stored and evicted: the replica publishes both (contract 7)."""
        start = time.perf_counter()
        result = self.store.put_many(items)
        self.stats.add(
            stores=1,
            store_seconds=time.perf_counter() - start,
            blocks_written=len(items),
            bytes_written=sum(len(blob) for _, blob in items),
        )
        return result

    def probe(self) -> None:
        pass

    def discard(self, key: bytes) -> None:
        self.store.discard(key)

    def close(self) -> None:
        """The store belongs to the process, not to this replica."""


def shared_store(configs: Sequence[SimConfig]) -> MemoryTier | None:
    """The store the replicas of one process share (None: none of them has one)."""
    sizes = {config.shared_store_blocks for config in configs if config.shared_store_blocks}
    if not sizes:
        return None
    if len(sizes) > 1:
        raise ValueError(f"replicas of one process share one store: shared_store_blocks differs ({sorted(sizes)})")
    store = MemoryTier(sizes.pop() * STAND_IN_BLOB_BYTES)
    store.store_id = f"sim-{uuid.uuid4().hex}"
    return store


WALL_GUARD_S = 1.0  # the least wall time a load's real reads get (the modeled deadline may be far shorter)


@dataclass(frozen=True, slots=True)
class TierTiming:
    """How long a tier takes to serve blocks, in simulated seconds."""

    source: str
    latency_s: float
    gb_per_s: float

    def block_seconds(self, block_bytes: int) -> float:
        return block_bytes / (self.gb_per_s * 1e9)


@dataclass(frozen=True, slots=True)
class TierCharge:
    """What one tier contributed to a load: blocks that arrived in time and the simulated seconds it took."""

    source: str
    blocks: int
    seconds: float


def model_load(
    served: Sequence[tuple[TierTiming, int]], block_bytes: int, budget_s: float, extension_s_per_block: float = 0.0
) -> list[TierCharge]:
    """Charges of one load that asked the tiers of `served` in order (each with the blocks it served), within
    `budget_s` simulated seconds, pushed back `extension_s_per_block` for each block that arrived (the engine's
    LoadDeadline): a tier whose blocks would not all arrive in time ends the load at the deadline with those that
    did, and no later tier is asked."""
    charges: list[TierCharge] = []
    elapsed = 0.0
    for timing, blocks in served:
        left = budget_s - elapsed
        per_block = timing.block_seconds(block_bytes)
        seconds = timing.latency_s + blocks * per_block
        if left >= 0 and seconds <= left + blocks * extension_s_per_block:
            charges.append(TierCharge(timing.source, blocks, seconds))
            elapsed += seconds
            budget_s += blocks * extension_s_per_block
            continue
        # Here per_block > extension_s_per_block: k blocks arrive in time while latency + k per_block <= left + k ext.
        in_time = 0
        if left > timing.latency_s:
            in_time = min(blocks, int((left - timing.latency_s) // (per_block - extension_s_per_block)))
        charges.append(TierCharge(timing.source, in_time, max(left + in_time * extension_s_per_block, 0.0)))
        break
    return charges


@dataclass(slots=True)
class ModeledLoads:
    """What loads from one tier would have cost in the simulated model."""

    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0  # simulated


class ModeledTierLink(KVTierLink):
    """The engine's tier link, its loads held back by their modeled time. `timings`: one per tier of `store`."""

    def __init__(self, store: TieredStore, timings: Sequence[TierTiming], config: SimConfig) -> None:
        super().__init__(store, TierStandInBlocks(), config.tier_load_deadline_s, config.tier_load_min_speedup)
        self.timings = list(timings)
        self.config = config
        self._busy_until = 0.0  # wall time the modeled load before ends; loader thread only
        self._modeled = {timing.source: ModeledLoads() for timing in timings}
        self._lock = threading.Lock()

    def start_fetch(self, root_key: bytes, keys: Sequence[bytes]) -> Future[Sequence[DecodedBlock]]:
        held: Future[Sequence[DecodedBlock]] = Future()
        self._loader.submit(self._load, root_key, keys, time.monotonic(), self.extension_s_per_block, held)
        return held

    def modeled(self) -> dict[str, ModeledLoads]:
        with self._lock:
            return {source: ModeledLoads(m.tokens, m.bytes, m.seconds) for source, m in self._modeled.items()}

    def snapshot(self) -> StoreSnapshot:
        return self.store.snapshot()

    def load_totals(self) -> dict[str, tuple[float, int]]:
        """The modeled seconds, in the simulated model's time like its steps (the real reads take microseconds)."""
        block_size = self.config.block_size
        return {
            ("shared" if source == SHARED else "local"): (loads.seconds, loads.tokens // block_size)
            for source, loads in self.modeled().items()
        }

    def _load(
        self,
        root_key: bytes,
        keys: Sequence[bytes],
        submitted: float,
        extension_s_per_block: float,
        held: Future[Sequence[DecodedBlock]],
    ) -> None:
        try:
            before = self._tier_counts()
            # The tiers are process memory, so the real read takes microseconds: the deadline is applied to the
            # modeled times, and the wall bound only guards against a stalled process.
            wall_deadline = submitted + max(self.load_deadline_s, WALL_GUARD_S) * max(1.0, self.config.time_scale)
            blocks = self.store.load_prefix(root_key, keys, self.format, wall_deadline)
            served = [
                (timing, hits1 - hits0)
                for timing, (hits0, loads0), (hits1, loads1) in zip(self.timings, before, self._tier_counts())
                if loads1 > loads0
            ]
            kept, release_at = self._charge(served, submitted, extension_s_per_block)
        except Exception as error:  # the engine logs it and computes the blocks: a miss, as on a real replica
            held.set_exception(error)
            return
        _release_at(held, LoadedBlocks(blocks[:kept], blocks.num_local), release_at)

    def _tier_counts(self) -> list[tuple[int, int]]:
        """Blocks served and lookups made by each tier so far; only this link's loader thread changes them."""
        counts = [tier.stats.snapshot() for tier in self.store.tiers]
        return [(c.hits, c.loads) for c in counts]

    def _charge(
        self, served: Sequence[tuple[TierTiming, int]], submitted: float, extension_s_per_block: float
    ) -> tuple[int, float]:
        """Blocks that arrive in time, and the wall time the load ends: after the load before it, like the real
        link's single loader thread, with the deadline counted from the request and pushed back per block."""
        scale = self.config.time_scale
        begin = max(submitted, self._busy_until)
        budget_s = self.load_deadline_s - (begin - submitted) / scale
        charges = model_load(served, self.config.kv_bytes_per_block, budget_s, extension_s_per_block)
        self._busy_until = begin + sum(charge.seconds for charge in charges) * scale
        with self._lock:
            for charge in charges:
                modeled = self._modeled[charge.source]
                modeled.tokens += charge.blocks * self.config.block_size
                modeled.bytes += charge.blocks * self.config.kv_bytes_per_block
                modeled.seconds += charge.seconds
        return sum(charge.blocks for charge in charges), self._busy_until


def _release_at(held: Future[Sequence[DecodedBlock]], blocks: Sequence[DecodedBlock], wall_time: float) -> None:
    delay = wall_time - time.monotonic()
    if delay <= 0:
        held.set_result(blocks)
        return
    timer = threading.Timer(delay, held.set_result, (blocks,))
    timer.daemon = True
    timer.start()


def build_tier_link(config: SimConfig, shared: MemoryTier | None) -> ModeledTierLink | None:
    """The replica's tier link: its host tier, then the shared store (None: it has neither)."""
    tiers: list[tuple[Tier, TierTiming]] = []
    if config.host_tier_blocks:
        tiers.append(
            (
                MemoryTier(config.host_tier_blocks * STAND_IN_BLOB_BYTES),
                TierTiming(HOST, 0.0, config.host_tier_gb_per_s),
            )
        )
    if config.shared_store_blocks and shared is not None:
        tiers.append(
            (SharedStoreView(shared), TierTiming(SHARED, config.shared_store_latency_s, config.shared_store_gb_per_s))
        )
    if not tiers:
        return None
    return ModeledTierLink(TieredStore([tier for tier, _ in tiers]), [timing for _, timing in tiers], config)

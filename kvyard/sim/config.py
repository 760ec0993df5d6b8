"""Settings of one simulated replica, and the engine core they build."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.api.checks import ContextLimits
from kvyard.engine.core import CoreConfig, EngineCore
from kvyard.engine.scheduling.scheduler import SchedulerConfig
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.config import KVTransferConfig
from kvyard.settings import setting
from kvyard.sim.cost_model import CostModel
from kvyard.sim.cost_runner import CostRunner
from kvyard.sim.tokens import ByteTokenizer


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Simulated replica: its identity (the block-key namespace), capacity and timing."""

    model_name: str = setting(
        "kvyard-sim", help="served model id; with the digest, dtype and block size it makes the block-key namespace"
    )
    model_digest: str = setting("sim", help="digest of the simulated weights, part of the block-key namespace")
    dtype: str = setting("float32", help="KV dtype in the block-key namespace")
    block_size: int = setting(16, help="tokens per KV block")
    num_kv_blocks: int = setting(4096, help="KV blocks of each replica (its prefix-cache capacity)")
    max_model_len: int = setting(131072, help="context length of the simulated model")
    vocab_size: int = setting(32000, help="vocabulary size (token ids are checked against it)")
    time_scale: float = setting(
        1.0,
        help="wall seconds per simulated second (0.1: ten times faster than the "
        "engine it models); KV-transfer pull deadlines scale with it",
    )
    stream_interval_s: float = setting(
        0.002,
        help="least wall time between two deliveries of a stream's tokens "
        "after its first (longer: fewer writes, less CPU)",
    )
    tick_s: float = setting(
        0.002,
        help="timing resolution: steps ending less than this ahead of the wall clock "
        "run without sleeping (longer: fewer wake-ups, less CPU)",
    )
    catch_up_s: float = setting(
        0.05,
        help="wall seconds a replica may fall behind its cost model while the process "
        "is busy elsewhere and still catch up, running its next steps back to back so its "
        "tokens keep the modeled times; further behind, it starts again from the present and "
        "the skipped time counts as lag (kvyard_sim_lag_seconds)",
    )
    # Moving KV between replicas (prefill/decode disaggregation): the blocks that really travel are small
    # stand-ins; a pull of B blocks is charged `transfer_seconds(B)` as if the model's KV had moved.
    kv_bytes_per_token: int = setting(
        16384,
        help="KV bytes per token of the simulated model, for the cost of a "
        "transfer; 16384 is the model the default cost model was calibrated on "
        "(kvyard's llama bench preset in float32: 8 layers x 2 (K and V) x 4 KV heads "
        "x 64 dims x 4 bytes)",
    )
    transfer_gb_per_s: float = setting(
        1.25,
        help="bandwidth of a KV transfer from a prefill replica, in GB/s "
        "(10^9 bytes); 1.25 is one 10 Gb/s Ethernet link",
    )
    transfer_latency_s: float = setting(
        0.001, help="simulated seconds every transfer takes on top of its bytes (connection and first byte on a LAN)"
    )
    # The KV tier below the device cache (`kvyard serve --kv-tier`): a host-memory tier per replica and a store shared
    # by every replica of the process, holding stand-in blocks; a load is charged latency plus its bytes (at
    # kv_bytes_per_token) over the bandwidth of the tier that served it. Writes are write-behind, off every request's
    # path, so they are not charged.
    host_tier_blocks: int = setting(
        0,
        help="blocks each replica keeps in its host-memory KV tier, least recently "
        "used evicted first (0: no host tier)",
    )
    host_tier_gb_per_s: float = setting(
        0.36,
        help="load bandwidth of the host-memory tier in GB/s (10^9 bytes), "
        "into the device cache; 0.36 is kvyard serve's memory tier end to end on a "
        "2-core CPU (benchmarks/results/kv_tier.json, memory, "
        "end_to_end_load_bandwidth_gb_s: a lower bound, the whole TTFT of a cached "
        "4096-token prompt over its bytes)",
    )
    shared_store_blocks: int = setting(
        0,
        help="blocks of a KV store shared by all replicas of this process, like "
        "kvyard serve's Redis tier, least recently used evicted first (0: no shared "
        "store)",
    )
    shared_store_gb_per_s: float = setting(
        0.23,
        help="read bandwidth of the shared store in GB/s (10^9 bytes); "
        "0.23 is kvyard's Redis tier on loopback, redis-py pipelines of 64 "
        "blocks of 524 KB (benchmarks/results/kv_transfer.json, "
        "redis_get_gb_per_s)",
    )
    shared_store_latency_s: float = setting(
        0.001,
        help="simulated seconds every lookup in the shared store takes on "
        "top of its bytes, a miss included (one LAN round trip; assumed, not "
        "measured)",
    )
    tier_load_deadline_s: float = setting(
        2.0,
        help="longest simulated wait for tier blocks at admission; blocks "
        "that would arrive later are recomputed (kvyard serve's "
        "--kv-load-deadline-s default)",
    )
    tier_load_min_speedup: float = setting(
        2.0,
        help="a tier load keeps going past its deadline while its blocks "
        "arrive at least this many times faster than the replica computes them "
        "(kvyard serve's --kv-load-min-speedup default); 0: stop at the "
        "deadline",
    )
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # The pull deadline is a time of the modeled engine (scaled by time_scale). The lease and the idle timeout stay
    # wall times, like the transfer server's own (heartbeats, the wait for a transfer not yet known): a lease scaled
    # alone would send a late pull into that unscaled wait.
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    cost: CostModel = field(default_factory=CostModel)  # from `--calibrate`, else the defaults
    event_log_capacity: int = 65536

    def __post_init__(self) -> None:
        for name in (
            "time_scale",
            "transfer_gb_per_s",
            "host_tier_gb_per_s",
            "shared_store_gb_per_s",
            "tier_load_deadline_s",
            "block_size",
            "num_kv_blocks",
            "max_model_len",
            "vocab_size",
            "event_log_capacity",
            "kv_bytes_per_token",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "stream_interval_s",
            "tick_s",
            "catch_up_s",
            "transfer_latency_s",
            "shared_store_latency_s",
            "host_tier_blocks",
            "shared_store_blocks",
            "tier_load_min_speedup",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(self.model_name, self.model_digest, self.dtype, self.block_size)

    @property
    def limits(self) -> ContextLimits:
        return ContextLimits(self.max_model_len, self.vocab_size, self.block_size, self.num_kv_blocks)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block's KV in the simulated model (what a transfer of it would move)."""
        return self.kv_bytes_per_token * self.block_size

    def transfer_seconds(self, num_blocks: int) -> float:
        """Simulated seconds to move `num_blocks` blocks from a prefill replica: latency plus bytes over
        bandwidth."""
        return self.transfer_latency_s + num_blocks * self.kv_bytes_per_block / (self.transfer_gb_per_s * 1e9)

    def streamed_transfer_seconds(self, num_blocks: int, open_s: float) -> float:
        """Simulated seconds a pull of `num_blocks` still takes once its last block is computed, when blocks
        stream while the prefill runs, as kvyard's pulls do (`open_s`: how long the pull was open by then). The
        link moves each chunk's blocks as the chunk completes, so at least the last chunk's blocks are left to
        move; and no link moves the whole faster than its bandwidth, counted from when the pull opened."""
        chunk_blocks = -(-self.prefill_chunk_tokens // self.block_size)
        return max(self.transfer_seconds(num_blocks) - open_s, self.transfer_seconds(min(num_blocks, chunk_blocks)))

    @property
    def prefill_chunk_tokens(self) -> int:
        """The largest chunk of a prompt a prefill replica computes in one step, which a pull waits for at once."""
        return max(self.scheduler.max_num_batched_tokens, self.scheduler.prefill_only_step_tokens)

    def core_config(self) -> CoreConfig:
        return CoreConfig(
            self.limits,
            self.scheduler,
            record_kv_events=True,
            event_log_capacity=self.event_log_capacity,
            kv_lease_s=self.kv_transfer.kv_lease_s,
        )

    def build_core(self) -> tuple[EngineCore, CostRunner]:
        """A fresh engine core (empty cache, events from sequence 1) and its cost runner."""
        runner = CostRunner(self.cost)
        return EngineCore(self.core_config(), self.namespace, runner, ByteTokenizer()), runner

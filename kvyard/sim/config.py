"""Settings of one simulated replica, and the engine core they build."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.api.checks import ContextLimits
from kvyard.engine.core import CoreConfig, EngineCore
from kvyard.engine.scheduler import SchedulerConfig
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.sim.cost_model import CostModel
from kvyard.sim.cost_runner import CostRunner
from kvyard.sim.tokens import ByteTokenizer


@dataclass(frozen=True, slots=True)
class SimConfig:
    model_name: str = "kvyard-sim"
    model_digest: str = "sim"  # with model_name, dtype and block_size: the block-key namespace
    dtype: str = "float32"
    block_size: int = 16
    capacity_blocks: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 131072
    vocab_size: int = 32000
    time_scale: float = 1.0  # wall seconds per simulated second
    stream_interval_s: float = 0.002  # least wall time between two deliveries of later tokens
    tick_s: float = 0.002  # steps ending less than this ahead of the wall clock run without sleeping
    cost: CostModel = field(default_factory=CostModel)
    event_log_capacity: int = 65536

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        for name in ("stream_interval_s", "tick_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("block_size", "capacity_blocks", "max_model_len", "vocab_size", "event_log_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs)  # checks them

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(self.model_name, self.model_digest, self.dtype, self.block_size)

    @property
    def limits(self) -> ContextLimits:
        return ContextLimits(self.max_model_len, self.vocab_size, self.block_size, self.capacity_blocks)

    def core_config(self) -> CoreConfig:
        return CoreConfig(
            limits=self.limits,
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs),
            record_kv_events=True,
            event_log_capacity=self.event_log_capacity,
        )

    def build_core(self) -> tuple[EngineCore, CostRunner]:
        """A fresh engine core (empty cache, events from sequence 1) and its cost runner."""
        runner = CostRunner(self.cost)
        return EngineCore(self.core_config(), self.namespace, runner, ByteTokenizer()), runner

"""Settings of one simulated replica, and the engine core they build."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.api.checks import ContextLimits
from kvyard.engine.core import CoreConfig, EngineCore
from kvyard.engine.scheduler import SchedulerConfig
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.settings import setting
from kvyard.sim.cost_model import CostModel
from kvyard.sim.cost_runner import CostRunner
from kvyard.sim.tokens import ByteTokenizer


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Simulated replica: its identity (the block-key namespace), capacity and timing."""

    model_name: str = setting("kvyard-sim", help="served model id; with the digest, dtype and block size it makes "
                              "the block-key namespace")  # fmt: skip
    model_digest: str = setting("sim", help="digest of the simulated weights, part of the block-key namespace")
    dtype: str = setting("float32", help="KV dtype in the block-key namespace")
    block_size: int = setting(16, help="tokens per KV block")
    num_kv_blocks: int = setting(4096, help="KV blocks of each replica (its prefix-cache capacity)")
    max_model_len: int = setting(131072, help="context length of the simulated model")
    vocab_size: int = setting(32000, help="vocabulary size (token ids are checked against it)")
    time_scale: float = setting(1.0, help="wall seconds per simulated second (0.1: ten times faster than the "
                                "engine it models)")  # fmt: skip
    stream_interval_s: float = setting(0.002, help="least wall time between two deliveries of a stream's tokens "
                                       "after its first (longer: fewer writes, less CPU)")  # fmt: skip
    tick_s: float = setting(0.002, help="timing resolution: steps ending less than this ahead of the wall clock "
                            "run without sleeping (longer: fewer wake-ups, less CPU)")  # fmt: skip
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cost: CostModel = field(default_factory=CostModel)  # from `--calibrate`, else the defaults
    event_log_capacity: int = 65536

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        for name in ("stream_interval_s", "tick_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("block_size", "num_kv_blocks", "max_model_len", "vocab_size", "event_log_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(self.model_name, self.model_digest, self.dtype, self.block_size)

    @property
    def limits(self) -> ContextLimits:
        return ContextLimits(self.max_model_len, self.vocab_size, self.block_size, self.num_kv_blocks)

    def core_config(self) -> CoreConfig:
        return CoreConfig(self.limits, self.scheduler, record_kv_events=True,
                          event_log_capacity=self.event_log_capacity)  # fmt: skip

    def build_core(self) -> tuple[EngineCore, CostRunner]:
        """A fresh engine core (empty cache, events from sequence 1) and its cost runner."""
        runner = CostRunner(self.cost)
        return EngineCore(self.core_config(), self.namespace, runner, ByteTokenizer()), runner

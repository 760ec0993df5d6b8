"""What work costs on this replica, measured as it runs: a prefill token (the router predicts time to first token
with it; the KV tier weighs a load against computing the block) and a block loaded from each tier medium."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.engine.scheduling.kv_cache_manager import BlockTier
from kvyard.kvcache.stats import RecentCost

MIN_MEASURED_PREFILL_TOKENS = 32  # steps this large say what a prefill token costs (decode-only steps do not)


@dataclass(slots=True)
class MeasuredCosts:
    prefill: RecentCost = field(default_factory=lambda: RecentCost(weight=0.1))
    tier_loads: dict[str, RecentCost] = field(default_factory=dict)

    @property
    def prefill_s_per_token(self) -> float | None:
        return self.prefill.estimate

    def observe_step(self, num_tokens: int, seconds: float, block_size: int, tier: BlockTier | None) -> None:
        """A step of `num_tokens`; the tier learns what computing a block costs now."""
        if num_tokens < MIN_MEASURED_PREFILL_TOKENS:
            return
        self.prefill.observe(seconds, num_tokens)
        if tier is not None and self.prefill.estimate is not None:
            tier.compute_s_per_block = self.prefill.estimate * block_size

    def tier_s_per_block(self, tier: BlockTier | None) -> dict[str, float]:
        """Recent seconds per block loaded, by medium, from the tier's running totals."""
        if tier is None:
            return {}
        costs: dict[str, float] = {}
        for medium, (seconds, blocks) in tier.load_totals().items():
            estimate = self.tier_loads.setdefault(medium, RecentCost()).update(seconds, blocks)
            if estimate is not None:
                costs[medium] = estimate
        return costs

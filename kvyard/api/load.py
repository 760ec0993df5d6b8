"""The load report (`GET /load`): what a replica tells routers about its queue and KV cache."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoadReport:
    num_waiting: int = 0  # requests queued in the engine
    num_running: int = 0  # requests being computed
    in_flight_requests: int = 0  # HTTP requests admitted and not yet answered (the admission count)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_in_flight: int = 0  # tokens of the running requests' sequences
    role: str = "unified"  # unified, prefill or decode (prefill/decode disaggregation)
    # What a router needs to predict time to first token in seconds (docs/contracts.md §7); 0: not measured yet.
    prefill_s_per_token: float = 0.0  # recent step seconds per token of steps that prefilled
    local_tier_s_per_block: float = 0.0  # recent load seconds per block from the replica's own lower tiers
    shared_tier_s_per_block: float = 0.0  # the same from the shared store
    shared_tier_available: bool = True  # False while the shared store fails (its lookups are misses)
    tier_load_deadline_s: float = 0.0  # a tier load gives up this long after the request arrived (0: no tier)
    # Each block a tier load brings pushes its deadline back this long (its compute time over the minimum speed-up).
    tier_load_extension_s_per_block: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kv_usage": self.kv_usage}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LoadReport:
        """Parse a replica's answer; a missing count is 0 (older or other servers). Raises on a wrong type."""
        role = body.get("role", "unified")
        if role not in ("unified", "prefill", "decode"):
            raise TypeError(f"load report field role is not a role: {role!r}")
        available = body.get("shared_tier_available", True)
        if not isinstance(available, bool):
            raise TypeError(f"load report field shared_tier_available is not a boolean: {available!r}")
        fields: dict[str, Any] = {name: int(_number(body, name)) for name in _COUNTS}
        fields.update({name: max(0.0, _number(body, name)) for name in _SECONDS})
        return cls(**fields, role=role, shared_tier_available=available)


_COUNTS = ("num_waiting", "num_running", "in_flight_requests", "kv_blocks_used", "kv_blocks_total", "tokens_in_flight")
_SECONDS = (
    "prefill_s_per_token",
    "local_tier_s_per_block",
    "shared_tier_s_per_block",
    "tier_load_deadline_s",
    "tier_load_extension_s_per_block",
)


def _number(body: dict[str, Any], name: str) -> float:
    value = body.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"load report field {name} is not a number: {value!r}")
    return float(value)

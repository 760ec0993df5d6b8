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
        return cls(**{name: _count(body, name) for name in cls.__dataclass_fields__ if name != "role"}, role=role)


def _count(body: dict[str, Any], name: str) -> int:
    value = body.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"load report field {name} is not a number: {value!r}")
    return int(value)

"""Router settings (the CLI fills these in)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("round_robin", "least_load", "session", "cache_aware")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "cache_aware"
    health_interval_s: float = 0.5
    health_timeout_s: float = 2.0
    eject_after_failures: int = 2
    connect_timeout_s: float = 3.0
    max_in_flight: int = 4096  # the router's bounded queue: beyond it, 429 with Retry-After
    max_attempts: int = 3  # replicas tried for one request before the first byte
    session_header: str = "x-session-id"
    # cache_aware cost model, in prefill-token equivalents: a running request slows a new prefill as much as
    # `running_request_cost` tokens of prefill, a waiting request of unknown size as much as `waiting_request_cost`.
    running_request_cost: float = 16.0
    waiting_request_cost: float = 512.0
    approx_block_size: int = 16  # block size of the learned index of replicas without KV events
    approx_index_blocks: int = 1 << 17
    tokenize_cache_entries: int = 8192

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.max_attempts < 1 or self.max_in_flight < 1:
            raise ValueError("max_attempts and max_in_flight must be at least 1")

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
    # cache_aware cost model, in prefill-token equivalents. Prefilling n new tokens after c cached ones costs
    # n + attention_pair_cost * (n*c + n*n/2): linear layers plus causal attention. The default is the ratio of
    # kvyard's attention-pair to prefill-token time on a CPU (sim cost model, calibrated from the engine); for
    # a GPU engine it is smaller. A running request slows a new prefill as much as `running_request_cost`
    # tokens of prefill, a waiting request of unknown size as much as `waiting_request_cost`.
    attention_pair_cost: float = 3.5e-4
    running_request_cost: float = 16.0
    waiting_request_cost: float = 512.0
    # Prefill work a choice adds to the fleet beyond the cheapest replica's (cache it forgoes) is charged this
    # many times over: under load, every replica's extra work delays the requests queued behind it.
    recompute_weight: float = 1.0
    # Moving a session away from the replica of its last turn is charged this many times the prefill work
    # that replica would have saved (its history is needed again next turn; a copy evicts others' histories).
    session_recompute_weight: float = 300.0
    max_sessions: int = 1 << 16  # sessions whose last replica is remembered (least recently seen forgotten)
    approx_block_size: int = 16  # block size of the learned index of replicas without KV events
    approx_index_blocks: int = 1 << 17
    tokenize_cache_entries: int = 8192

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.max_attempts < 1 or self.max_in_flight < 1:
            raise ValueError("max_attempts and max_in_flight must be at least 1")

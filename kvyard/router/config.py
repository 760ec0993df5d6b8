"""Router settings; the command line's options are generated from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.api.auth import AccessConfig
from kvyard.net.http_server import HttpServerConfig
from kvyard.router.tier_index import MAX_KEYS_PER_STORE
from kvyard.settings import setting

POLICIES = ("round_robin", "least_load", "session", "cache_aware")
DISAGGREGATION = ("conditional", "always")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router: policy, health checks and limits."""

    policy: str = setting("cache_aware", choices=POLICIES, help="how a replica is chosen")
    health_interval_s: float = setting(
        0.5, help="seconds between health checks of each replica (none while it answers requests)"
    )
    max_health_checks_per_s: float = setting(
        200.0,
        help="health checks of all replicas together per second at "
        "most: a large fleet's are spread out (1,000 replicas: each every "
        "5 s); a failed request still ejects a replica at once",
    )
    health_timeout_s: float = setting(2.0, help="a health check slower than this fails")
    eject_after_failures: int = setting(2, help="failed health checks in a row before a replica is ejected")
    # When most of a fleet fails its checks at once, the likelier cause is overload slowing the checks (or the
    # checks' own path), not most replicas dying together; ejecting them all would turn slowness into an outage.
    panic_threshold: float = setting(
        0.5,
        help="below this fraction of replicas healthy (drained ones aside), route "
        "to ejected replicas too, as if all were healthy; requests that fail on one "
        "are retried on another (0: never)",
    )
    connect_timeout_s: float = setting(3.0, help="longest wait to connect to a replica")
    max_in_flight: int = setting(4096, help="requests proxied at once; beyond it, 429 with Retry-After")
    max_attempts: int = setting(3, help="replicas tried for one request before its first byte")
    session_header: str = setting(
        "x-session-id", help="header that names a session (policy session; the request's 'user' field otherwise)"
    )
    # cache_aware cost model, in prefill-token equivalents. Prefilling n new tokens after c cached ones costs
    # n + attention_pair_cost * (n*c + n*n/2): linear layers plus causal attention. The default is the ratio of
    # kvyard's attention-pair to prefill-token time on a CPU (sim cost model, calibrated from the engine); for
    # a GPU engine it is smaller. A running request slows a new prefill as much as `running_request_cost`
    # tokens of prefill, a waiting request of unknown size as much as `waiting_request_cost`.
    attention_pair_cost: float = setting(
        3.5e-4, help="cache_aware: cost of one (query, key) pair of prefill attention, in prefill-token equivalents"
    )
    running_request_cost: float = setting(
        16.0, help="cache_aware: how much a running request slows a new prefill, in prefill tokens"
    )
    waiting_request_cost: float = setting(512.0, help="cache_aware: the same for a waiting request of unknown size")
    # Prefill work a choice adds to the fleet beyond the cheapest replica's (cache it forgoes) is charged this
    # many times over: under load, every replica's extra work delays the requests queued behind it.
    recompute_weight: float = setting(
        1.0, help="cache_aware: weight of the prefill work a replica adds to the fleet by not reusing another's cache"
    )
    # Moving a session away from the replica of its last turn is charged this many times the prefill work
    # that replica would have saved (its history is needed again next turn; a copy evicts others' histories).
    session_recompute_weight: float = setting(
        300.0, help="cache_aware: the same for moving a session away from the replica that served its last turn"
    )
    # A conversation's later turns follow its history: placing its turn also places them (router.conversations).
    conversation_weight: float = setting(
        1.0,
        help="cache_aware: weight of the queueing a placement commits a "
        "conversation's later turns to (the conversations already at home on "
        "the replica; 0: place each request for itself)",
    )
    # Long prompts on replicas that hold none keep those replicas from the short requests that would wait there
    # least: charged per replica without long work, more as fewer are left (router.policies, CacheAware). Long is
    # relative to the prompts the router sees, so the rule follows the workload instead of a length.
    long_prompt_factor: float = setting(
        8.0,
        help="cache_aware: a prompt whose prefill work is this many times the median of recent prompts' counts as "
        "long; placed on a replica with no long work queued, it is charged --long-prompt-weight times its work "
        "over the replicas left without any (0: off)",
    )
    long_prompt_tokens: int = setting(
        0, help="cache_aware: long prompts from this much prefill work instead of --long-prompt-factor (0: by factor)"
    )
    long_prompt_weight: float = setting(1.0, help="cache_aware: see --long-prompt-factor")
    disaggregation: str = setting(
        "conditional",
        choices=DISAGGREGATION,
        help="with prefill replicas: send every "
        "request's prefill to one (always), or only when the decode replica would have more "
        "than --pd-local-prefill-tokens to compute, unless it would start the prompt sooner "
        "than the prefill pool within --pd-decode-prefill-budget (conditional)",
    )
    pd_local_prefill_tokens: int = setting(
        512,
        help="conditional disaggregation: a decode replica with at most this "
        "many prompt tokens to compute prefills them itself",
    )
    # Each 2,048 tokens of prefill queued on a decode replica cost its streams about one chunk-sized step.
    pd_decode_prefill_budget: int = setting(
        16384,
        help="conditional disaggregation: a decode replica that runs "
        "decodes prefills a prompt itself when it would start there sooner "
        "than in the prefill pool, as long as the prefill work queued on it "
        "stays within this many tokens (0: only an idle one does)",
    )
    # A running request takes a share of every decode step for the rest of its output: ~64 more steps of one
    # sequence weigh as much as 256 prefill tokens in the sim cost model (1.8 ms per sequence, 0.43 per token).
    pd_decode_request_cost: float = setting(
        256.0,
        help="disaggregated requests: how much a request running on a "
        "decode replica weighs, in prefill tokens, against the tokens a "
        "replica would have to pull",
    )
    replica_api_key: str | None = setting(
        None,
        help="the key the router sends to replicas (also "
        "$KVYARD_REPLICA_API_KEY); a client's own key never goes upstream",
        default_text="none",
        secret=True,
    )
    replica_admin_key: str | None = setting(
        None,
        help="the replicas' admin key, to follow their KV events (also $KVYARD_REPLICA_ADMIN_KEY)",
        default_text="none: each replica's cache index is learned from the prompts routed to it",
        secret=True,
    )
    access: AccessConfig = field(default_factory=AccessConfig)  # admin plane here: /admin/*
    http: HttpServerConfig = field(default_factory=HttpServerConfig)
    prefill_s_per_token: float = 1e-4  # cache_aware's guess until replicas report their own (GET /load)
    max_sessions: int = 1 << 16  # sessions whose last replica is remembered (least recently seen forgotten)
    approx_block_size: int = 16  # block size of the learned index of replicas without KV events
    approx_index_blocks: int = 1 << 17
    # cache_aware scores every candidate up to this many; beyond, a shortlist (policies.CacheAware._shortlist).
    full_scan_replicas: int = 64
    tokenize_cache_entries: int = 8192
    shared_index_keys: int = setting(
        MAX_KEYS_PER_STORE,
        help="block keys remembered per shared store (about 100 "
        "bytes each); beyond, the oldest are forgotten: a miss predicted, never a "
        "wrong hit",
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        object.__setattr__(self, "session_header", self.session_header.lower())  # as the HTTP server stores it
        if self.disaggregation not in DISAGGREGATION:
            raise ValueError(f"disaggregation must be one of {', '.join(DISAGGREGATION)}, got {self.disaggregation!r}")
        if self.max_attempts < 1 or self.max_in_flight < 1:
            raise ValueError("max_attempts and max_in_flight must be at least 1")
        if not 0.0 <= self.panic_threshold <= 1.0:
            raise ValueError(f"--panic-threshold must be between 0 and 1, got {self.panic_threshold}")
        if self.shared_index_keys < 1:
            raise ValueError(f"--shared-index-keys must be at least 1, got {self.shared_index_keys}")
        for name in (
            "pd_local_prefill_tokens",
            "pd_decode_prefill_budget",
            "attention_pair_cost",
            "running_request_cost",
            "waiting_request_cost",
            "recompute_weight",
            "session_recompute_weight",
            "conversation_weight",
            "long_prompt_weight",
            "long_prompt_factor",
            "long_prompt_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")

"""One upstream replica as the router sees it: health state, reported load, its own in-flight work."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvyard.api.engine_kv_events import EventEndpoints
from kvyard.api.kv_events import BlendAdvert
from kvyard.api.load import LoadReport
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.stats import RecentCost
from kvyard.net.http_client import HttpClient
from kvyard.router.cache_index import CacheIndex
from kvyard.router.ttft_fit import TtftFit


class State(enum.StrEnum):
    HEALTHY = "healthy"
    EJECTED = "ejected"  # failed health checks or requests; probed until it answers again
    DRAINING = "draining"  # finishes what it has, gets nothing new (admin API)


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What a replica's /v1/models says of one model: the fields the router passes on."""

    id: str
    created: int | None = None
    owned_by: str | None = None
    max_model_len: int | None = None
    parent: str | None = None  # the base model of a LoRA adapter (vLLM lists adapters beside their base)
    root: str | None = None  # where the server loaded it from (vLLM)

    @classmethod
    def from_json(cls, card: dict[str, Any]) -> ModelCard:
        def number(name: str) -> int | None:
            value = card.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        def text(name: str) -> str | None:
            value = card.get(name)
            return value if isinstance(value, str) else None

        return cls(
            str(card["id"]), number("created"), text("owned_by"), number("max_model_len"), text("parent"), text("root")
        )


@dataclass(slots=True, eq=False)  # identity: replicas are keys of the fleet's key -> holders index
class Replica:
    url: str
    state: State = State.HEALTHY
    kind: str = ""  # kvyard, vllm, sglang or openai (engine_probe), asked of the replica; "" until it answers
    events: EventEndpoints | None = None  # a vLLM or SGLang replica's KV-event publisher (ZMQ)
    configured_role: str | None = None  # --prefill/--decode; None: the role its load report states
    index: CacheIndex = field(default_factory=CacheIndex)
    namespace: KeyNamespace | None = None  # from /kv/snapshot; None for a replica without KV events
    # The shared KV store it loads from (tier_index), from its KV events (kvyard) or its metrics (vLLM with kvyard's
    # connector).
    shared_store_id: str | None = None
    blend: BlendAdvert | None = None  # it blends moved text (kvyard serve --non-prefix-reuse), from its snapshot
    salt_key: str | None = None  # the router's key, when the replica salts its cache by caller key (tenant_salt)
    model_ids: tuple[str, ...] = ()
    model_cards: tuple[ModelCard, ...] = ()  # as its /v1/models describes them
    lora_ids: frozenset[str] = frozenset()  # the models it serves that are LoRA adapters (their blocks differ)
    load: LoadReport = field(default_factory=LoadReport)
    # The router's own account of work it sent, so a burst is scored on what it just did, not on the
    # last load report: requests waiting for their first byte and the prefill work still to do for them.
    awaiting_first_byte: int = 0
    first_bytes_since_load: int = 0  # requests that left the replica's queue since its last load report
    # The router's own streams and requests awaiting their first byte when the last load report came: what the
    # report counts beyond them came from other clients.
    streaming_at_load: int = 0
    awaiting_at_load: int = 0
    pending_prefill_cost: float = 0.0  # prefill-token equivalents (see RouterConfig)
    pending_load_s: float = 0.0  # predicted KV-tier load seconds of those requests (one loader: they queue)
    pending_kv_tokens: int = 0  # KV tokens those requests will hold (prompt and asked output), where known
    streaming: int = 0
    in_flight: int = 0
    consecutive_failures: int = 0
    ejections: int = 0
    resyncs: int = 0
    connect_timeout_s: float = 3.0
    ttft: TtftFit = field(default_factory=TtftFit)  # its engine's speed from first-token times (ttft_fit), shared
    started_at: float | None = None  # its server's start time, where its metrics say (a change is a restart)
    metrics_at: float = -1e9  # time.monotonic() of its last metrics scrape (vLLM, SGLang)
    answered_at: float = -1e9  # time.monotonic() when a proxied request last got bytes from it: it is up
    # Recent load seconds per block by tier medium, from the totals its metrics give (vLLM with kvyard's connector).
    tier_costs: dict[str, RecentCost] = field(default_factory=dict)
    report_reuse_until: float = 0.0  # time.monotonic() until which it is asked to announce reused blocks (vLLM)
    api_headers: dict[str, str] = field(default_factory=dict)  # the router's own key, on every call
    admin_headers: dict[str, str] = field(default_factory=dict)  # the replicas' admin key, for /kv/*
    pd_headers: dict[str, str] = field(default_factory=dict)  # the same key as PD legs carry it
    http: HttpClient = field(init=False)  # the proxy's keep-alive connections to this replica

    def __post_init__(self) -> None:
        self.http = HttpClient(self.url, connect_timeout=self.connect_timeout_s)

    @property
    def role(self) -> str:
        """unified, prefill or decode (prefill/decode disaggregation)."""
        return self.configured_role or self.load.role

    @property
    def routable(self) -> bool:
        return self.state is State.HEALTHY

    def queue_depth(self) -> int:
        """Requests ahead of a new one: reported load, or the router's own count when that is fresher."""
        reported = self.load.num_waiting + self.load.num_running
        return max(reported, self.in_flight)

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "state": self.state.value,
            "role": self.role,
            "kind": self.kind or "unknown",
            "models": list(self.model_ids),
            "kv_events": self.index.has_events,
            "kv_events_endpoint": str(self.events) if self.events is not None else None,
            "index_blocks": self.index.num_blocks,
            "segment_blocks": len(self.index.segments.of_key),  # announced by a replica that blends moved text
            "local_tier_blocks": len(self.index.local),
            "shared_store": self.shared_store_id,
            "index_seq": self.index.seq,
            "block_size": self.namespace.block_size if self.namespace is not None else None,
            "s_per_prefill_token": self.load.prefill_s_per_token,
            "resyncs": self.resyncs,
            "ejections": self.ejections,
            "in_flight": self.in_flight,
            "pending_prefill_cost": round(self.pending_prefill_cost, 1),
            "pending_kv_tokens": self.pending_kv_tokens,
            "load": self.load.to_json(),
        }

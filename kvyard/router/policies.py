"""Routing policies: pick one replica among the routable candidates for one request."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvyard.kvcache.block_key import KeyNamespace
from kvyard.router.config import RouterConfig
from kvyard.router.keys import PromptKeys
from kvyard.router.replica import Replica

RING_POINTS_PER_REPLICA = 64
UncachedCost = Callable[[int, int], float]  # (prompt tokens a replica lacks, tokens it holds) -> cost


@dataclass(slots=True)
class RouteRequest:
    kind: str  # "completion" or "chat"
    body: dict[str, Any]
    session_key: str | None
    token_ids: list[int] | None
    cache_salt: str | None


@dataclass(slots=True)
class Decision:
    replica: Replica
    predicted_cached_tokens: int | None = None
    prefill_cost: float = 0.0  # work the replica is predicted to do before the first token (CacheAware)
    keys: list[bytes] | None = None  # the prompt's block keys in the replica's namespace (for the index)
    headers: dict[str, str] | None = None  # beyond the router's own key (the admin key of a PD leg)


class Policy(Protocol):
    def choose(self, request: RouteRequest, candidates: list[Replica]) -> Decision: ...


@dataclass(slots=True)
class RoundRobin:
    _counter: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, request: RouteRequest, candidates: list[Replica]) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)])


@dataclass(slots=True)
class LeastLoad:
    """Power of two choices on reported load (plus what the router sent since the last report)."""

    rng: random.Random = field(default_factory=random.Random)

    def choose(self, request: RouteRequest, candidates: list[Replica]) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0])
        first, second = self.rng.sample(candidates, 2)
        return Decision(first if first.queue_depth() <= second.queue_depth() else second)


@dataclass(slots=True)
class SessionAffinity:
    """Consistent hashing of the session key over every registered replica, healthy or not, so a session
    stays where it is while its replica is up and only the sessions of a failed replica move."""

    fallback: LeastLoad = field(default_factory=LeastLoad)
    _ring_urls: tuple[str, ...] = ()
    _points: list[int] = field(default_factory=list)
    _owners: list[str] = field(default_factory=list)

    def choose(self, request: RouteRequest, candidates: list[Replica]) -> Decision:
        if request.session_key is None:
            return self.fallback.choose(request, candidates)
        by_url = {replica.url: replica for replica in candidates}
        self._build_ring(tuple(sorted(by_url)))
        start = bisect.bisect(self._points, _hash64(request.session_key.encode()))
        for step in range(len(self._owners)):
            owner = by_url.get(self._owners[(start + step) % len(self._owners)])
            if owner is not None:
                return Decision(owner)
        return self.fallback.choose(request, candidates)

    def _build_ring(self, urls: tuple[str, ...]) -> None:
        if set(urls) <= set(self._ring_urls):
            return
        urls = tuple(sorted(set(urls) | set(self._ring_urls)))
        ring = sorted((_hash64(f"{url}#{i}".encode()), url) for url in urls for i in range(RING_POINTS_PER_REPLICA))
        self._ring_urls = urls
        self._points = [point for point, _ in ring]
        self._owners = [url for _, url in ring]


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(slots=True)
class CacheAware:
    """Least predicted time to first token, per request, in prefill-token equivalents:

        queue(replica) + prefill(replica) + recompute_weight * (prefill(replica) - cheapest prefill anywhere)

    prefill(replica) is the cost of the prompt tokens the replica does not hold (linear layers plus causal
    attention over the cached part, RouterConfig). The queue counts the prefill work of requests the router
    sent that have not produced a first byte yet (known exactly, so a burst sees its own earlier members),
    requests other clients queued there (from the load report), and running requests that share each step
    with a new prefill. The last term charges a replica for the work it adds to the fleet by not reusing a
    cache another replica holds, which delays everyone queued behind it. Moving a session (a header or the
    `user` field) away from the replica that served its last turn is charged `session_recompute_weight`
    times the prefill that replica would have saved: a conversation's history is needed again by its next
    turn, and a copy elsewhere evicts other sessions' histories, while a prefix shared by many sessions is
    worth holding twice when its replica is overloaded. There is no global switch between
    cache and load: a hot prefix whose replica is overloaded costs more there than a full prefill elsewhere,
    so it moves to a second replica, which then holds it too.
    """

    config: RouterConfig
    _decisions: itertools.count[int] = field(default_factory=itertools.count)
    _last_chosen: dict[str, int] = field(default_factory=dict)  # url -> number of the decision that last chose it
    _roots: dict[tuple[KeyNamespace, str | None], bytes] = field(default_factory=dict)
    _last_replica: OrderedDict[str, str] = field(default_factory=OrderedDict)  # session key -> url

    def choose(
        self, request: RouteRequest, candidates: list[Replica], uncached_cost: UncachedCost | None = None
    ) -> Decision:
        """`uncached_cost(num_new, num_cached)`: what the prompt tokens a replica lacks cost it (default: their
        prefill; a decode replica that pulls them from a prefill replica pays only their transfer)."""
        cost_of = uncached_cost or self.prefill_cost
        tokens = request.token_ids
        now = time.monotonic()
        keys_by_root: dict[tuple[bytes, int], PromptKeys] = {}
        options: list[tuple[Replica, int | None, float]] = []  # (replica, predicted cached tokens, prefill cost)
        for replica in candidates:
            cached = self._cached_tokens(request, replica, keys_by_root, now) if tokens else None
            cost = cost_of(len(tokens) - (cached or 0), cached or 0) if tokens else 0.0
            options.append((replica, cached, cost))
        cheapest = min(cost for _, _, cost in options)
        home_url = self._last_replica.get(request.session_key) if request.session_key else None
        home_cost = next((cost for replica, _, cost in options if replica.url == home_url), None)
        best: tuple[float, int, int, int] | None = None
        chosen: Decision | None = None
        for replica, cached, cost in options:
            extra = self.config.recompute_weight * (cost - cheapest)
            if home_cost is not None and replica.url != home_url:
                extra += self.config.session_recompute_weight * max(0.0, cost - home_cost)
            # Equal replicas (e.g. idle ones for a new conversation) take turns: the least recently chosen wins.
            last_chosen = self._last_chosen.get(replica.url, -1)
            rank = (self._queue_cost(replica) + cost + extra, -(cached or 0), replica.in_flight, last_chosen)
            if best is None or rank < best:
                best, chosen = rank, Decision(replica, cached, cost, None)
        assert chosen is not None
        self._last_chosen[chosen.replica.url] = next(self._decisions)
        if request.session_key:
            self._remember_session(request.session_key, chosen.replica.url)
        if tokens:
            chosen.keys = keys_by_root[self._root(request, chosen.replica)].all()
        return chosen

    def predicted_cached_tokens(self, request: RouteRequest, replica: Replica) -> int | None:
        """Prompt tokens `replica` holds, as `choose` predicts them (no decision is recorded)."""
        if not request.token_ids:
            return None
        return self._cached_tokens(request, replica, {}, time.monotonic())

    def _remember_session(self, session_key: str, url: str) -> None:
        self._last_replica[session_key] = url
        self._last_replica.move_to_end(session_key)
        if len(self._last_replica) > self.config.max_sessions:
            self._last_replica.popitem(last=False)

    def prefill_cost(self, num_new: int, num_cached: int) -> float:
        pairs = num_new * num_cached + num_new * num_new / 2
        return num_new + self.config.attention_pair_cost * pairs

    def _cached_tokens(
        self, request: RouteRequest, replica: Replica, keys_by_root: dict[tuple[bytes, int], PromptKeys], now: float
    ) -> int | None:
        """Prompt tokens the replica holds (None when the prompt has no keys to look up)."""
        prompt_keys = self._prompt_keys(request, replica, keys_by_root)
        if prompt_keys is None:
            return None
        max_blocks = (len(request.token_ids or ()) - 1) // prompt_keys.block_size  # the last token is computed
        blocks = 0
        while blocks < max_blocks and replica.index.holds(prompt_keys.key(blocks), now):
            blocks += 1
        return blocks * prompt_keys.block_size

    def queue_cost(self, replica: Replica) -> float:
        """The work ahead of a new request on `replica`, in prefill-token equivalents."""
        return self._queue_cost(replica)

    def _queue_cost(self, replica: Replica) -> float:
        config, load = self.config, replica.load
        # Waiting requests the report counts and the router knows are not waiting (any more) are not ahead.
        external_waiting = max(0, load.num_waiting - replica.awaiting_first_byte - replica.first_bytes_since_load)
        running = max(load.num_running, replica.streaming)
        return (
            replica.pending_prefill_cost
            + external_waiting * config.waiting_request_cost
            + running * config.running_request_cost
        )

    def _root(self, request: RouteRequest, replica: Replica) -> tuple[bytes, int]:
        namespace = replica.namespace
        if namespace is None:
            model = str(request.body.get("model") or (replica.model_ids[0] if replica.model_ids else ""))
            namespace = KeyNamespace(model, "router-approx", "", self.config.approx_block_size)
        root = self._roots.get((namespace, request.cache_salt))
        if root is None:
            if len(self._roots) > 4096:
                self._roots.clear()
            root = self._roots[(namespace, request.cache_salt)] = namespace.with_salt(request.cache_salt).root_key()
        return root, namespace.block_size

    def _prompt_keys(
        self, request: RouteRequest, replica: Replica, keys_by_root: dict[tuple[bytes, int], PromptKeys]
    ) -> PromptKeys | None:
        root = self._root(request, replica)
        if request.token_ids is None:
            return None
        prompt_keys = keys_by_root.get(root)
        if prompt_keys is None:
            prompt_keys = keys_by_root[root] = PromptKeys.of(root[0], root[1], request.token_ids)
        return prompt_keys


def make_policy(config: RouterConfig) -> Policy:
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_load":
        return LeastLoad()
    if config.policy == "session":
        return SessionAffinity()
    return CacheAware(config)

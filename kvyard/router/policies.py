"""Routing policies: pick one replica among the routable candidates for one request."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvyard.kvcache.block_key import KeyNamespace
from kvyard.router.config import RouterConfig
from kvyard.router.keys import PromptKeys
from kvyard.router.replica import Replica

RING_POINTS_PER_REPLICA = 64


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
    prefill_tokens: int = 0  # tokens the replica is predicted to compute before the first token
    keys: list[bytes] | None = None  # the prompt's block keys in the replica's namespace (for the index)


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

    queue(replica) + prompt tokens the replica does not hold. The queue counts the prefill tokens of
    requests the router sent that have not produced a first byte yet (known exactly, so a burst sees its
    own earlier members), requests other clients queued there (from the load report), and running
    requests that share each step with a new prefill. There is no global switch between cache and load:
    a hot prefix whose replica is overloaded costs more there than a full prefill elsewhere, so it moves
    to a second replica, which then holds it too.
    """

    config: RouterConfig
    rng: random.Random = field(default_factory=random.Random)
    _roots: dict[tuple[KeyNamespace, str | None], bytes] = field(default_factory=dict)

    def choose(self, request: RouteRequest, candidates: list[Replica]) -> Decision:
        tokens = request.token_ids
        now = time.monotonic()
        keys_by_root: dict[tuple[bytes, int], PromptKeys] = {}
        best: tuple[float, int, int, float] | None = None
        chosen: Decision | None = None
        for replica in candidates:
            prompt_keys = self._prompt_keys(request, replica, keys_by_root) if tokens else None
            cached = 0
            if prompt_keys is not None:
                max_blocks = (len(tokens or ()) - 1) // prompt_keys.block_size  # the last token is always computed
                blocks = 0
                while blocks < max_blocks and replica.index.holds(prompt_keys.key(blocks), now):
                    blocks += 1
                cached = blocks * prompt_keys.block_size
            uncached = len(tokens) - cached if tokens else 0
            score = self._queue_cost(replica) + uncached
            rank = (score, -cached, replica.in_flight, self.rng.random())
            if best is None or rank < best:
                best = rank
                predicted = cached if prompt_keys is not None else None
                chosen = Decision(replica, predicted, uncached, None)
        assert chosen is not None
        if tokens:
            chosen.keys = keys_by_root[self._root(request, chosen.replica)].all()
        return chosen

    def _queue_cost(self, replica: Replica) -> float:
        config, load = self.config, replica.load
        external_waiting = max(0, load.num_waiting - replica.awaiting_first_byte)
        running = max(load.num_running, replica.streaming)
        return (
            replica.pending_prefill_tokens
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

"""Routing policies: pick one replica among the routable candidates for one request."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvyard.api.auth import tenant_salt
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.segment_key import prompt_fingerprints
from kvyard.router.config import RouterConfig
from kvyard.router.conversations import LiveConversations
from kvyard.router.engine_probe import KVYARD
from kvyard.router.holders import KeyHolders
from kvyard.router.keys import PromptKeys
from kvyard.router.replica import Replica
from kvyard.router.segment_holds import PromptWindows
from kvyard.router.tier_index import SharedStores

RING_POINTS_PER_REPLICA = 64
DEEPEST_HOLDERS = 4  # large fleets: replicas scored among those holding the prompt's longest cached prefix
FIRST_BLOCK_HOLDERS = 2  # ... among those holding only its first block (a shared system prompt)
RANDOM_SAMPLE = 4  # ... drawn from the whole fleet, for load (power of d choices)
SMALL_GROUP = 64  # holder groups up to this size are sampled directly, larger ones by draws from the fleet
MAX_DRAWS = 64  # draws from the fleet for one sample of a large holder group
RATES_TTL_S = 1.0  # large fleets: the fleet's median rates are computed at most this often
UncachedCost = Callable[[int, int], float]  # (prompt tokens a replica lacks, tokens it holds) -> cost


@dataclass(slots=True)
class RouteRequest:
    kind: str  # "completion" or "chat"
    body: dict[str, Any]
    session_key: str | None
    token_ids: Sequence[int] | None
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class CachedSplit:
    """Prompt tokens a replica is predicted to hold, by where they are: its device cache, its own lower tiers
    (host memory, disk) and the shared store (docs/contracts.md §7)."""

    device: int = 0
    local: int = 0
    shared: int = 0

    @property
    def total(self) -> int:
        return self.device + self.local + self.shared

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "local": self.local, "shared": self.shared}


@dataclass(slots=True)
class Decision:
    replica: Replica
    predicted_cached_tokens: int | None = None
    predicted_split: CachedSplit | None = None
    prefill_cost: float = 0.0  # work the replica is predicted to do before the first token (CacheAware)
    load_s: float = 0.0  # predicted seconds of its KV-tier loads (CacheAware)
    kv_tokens: int = 0  # KV tokens the request will hold there (prompt and asked output; PD decode legs)
    prefill_ahead: float = 0.0  # prefill work queued there when it was decided, in prefill-token equivalents
    running: int = 0  # requests running there when it was decided (CacheAware)
    homed: int = 0  # live conversations at home there when it was decided (CacheAware)
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
    """Least predicted time to first token, per request, in seconds:

        queue(replica) + prefill(replica) + recompute_weight * (prefill(replica) - cheapest prefill anywhere)

    prefill(replica) is the time to load what the replica's lower tiers and the shared store hold (blocks times
    the load seconds per block it reports for that medium; its device cache is free) plus the time to compute
    the prompt tokens it holds nowhere (linear layers plus causal attention over the cached part, in
    prefill-token equivalents, RouterConfig, times the fleet's reported seconds per prefill token). The queue
    counts the prefill work of requests the router sent that have not produced a first byte yet (known exactly,
    so a burst sees its own earlier members), requests other clients queued there (from the load report), and
    running requests that share each step with a new prefill. The last term charges a replica for the work it
    adds to the fleet by not reusing a cache another replica holds, which delays everyone queued behind it.
    Moving a session (a header or the `user` field) away from the replica that served its last turn is charged
    `session_recompute_weight` times the prefill that replica would have saved: a conversation's history is
    needed again by its next turn, and a copy elsewhere evicts other sessions' histories, while a prefix shared by
    many sessions is worth holding twice when its replica is overloaded. A request is its session's next turn only
    when its prompt starts with most of the session's last one: a key shared by many conversations keeps none of
    them home. Loads are not charged these weights: a load delays only its own request, and what a copy evicts stays
    loadable. So when the shared store holds the history, a move costs only its load, and a continuing turn leaves a
    busy replica for an idle one. There is no global switch between cache and load: a hot prefix whose replica is
    overloaded costs more there than a full prefill elsewhere, so it moves to a second replica, which then holds it
    too.
    """

    config: RouterConfig
    shared_stores: SharedStores = field(default_factory=SharedStores)
    holders: KeyHolders | None = None  # the fleet's key -> replicas index (large fleets score a shortlist)
    rng: random.Random = field(default_factory=random.Random)
    _fleet: _FleetView | None = None  # lookups over the last large candidate list
    _decisions: itertools.count[int] = field(default_factory=itertools.count)
    _last_chosen: dict[str, int] = field(default_factory=dict)  # url -> number of the decision that last chose it
    _roots: dict[tuple[KeyNamespace, str | None], bytes] = field(default_factory=dict)
    _last_replica: OrderedDict[str, SessionTurn] = field(default_factory=OrderedDict)  # session key -> last turn
    conversations: LiveConversations = field(default_factory=LiveConversations)
    work_median: float | None = None  # running median of placed prompts' prefill work (long_prompt_factor)

    def choose(
        self, request: RouteRequest, candidates: list[Replica], uncached_cost: UncachedCost | None = None
    ) -> Decision:
        """`uncached_cost(num_new, num_cached)`: what the prompt tokens a replica lacks cost it (default: their
        prefill; a decode replica that pulls them from a prefill replica pays only their transfer)."""
        cost_of = uncached_cost or self.prefill_cost
        tokens = request.token_ids
        now = time.monotonic()
        keys_by_root: dict[Any, PromptKeys] = {}
        last_turn = self._last_replica.get(request.session_key) if request.session_key else None
        home_url = last_turn.url if last_turn is not None else None
        if len(candidates) > self.config.full_scan_replicas:
            fleet = self._fleet_view(candidates, now)
            rates = fleet.rates
            candidates = self._shortlist(request, fleet, keys_by_root, home_url)
        else:
            rates = self.fleet_rates(candidates)
        config = self.config
        options: list[tuple[Replica, tuple[int, int, int] | None, float]] = []  # (replica, tokens held, cost)
        windows: dict[bytes, PromptWindows] = {}  # the prompt's window fingerprints, per namespace root
        blends: set[str] = set()  # replicas that would blend moved text into this prompt
        for replica in candidates:
            if tokens:
                held = self._tokens_held(request, replica, keys_by_root, now, rates)
                cached = held[0] + held[1] + held[2] if held is not None else 0
                saved = self._moved_tokens_saved(request, replica, windows, cached) if uncached_cost is None else 0
                if saved:
                    blends.add(replica.url)
                options.append((replica, held, cost_of(len(tokens) - cached - saved, cached + saved)))
            else:
                options.append((replica, None, 0.0))
        cheapest = min(cost for _, _, cost in options)
        home = next((replica for replica, _, _ in options if replica.url == home_url), None)
        if home is not None and last_turn is not None and not self._continues(request, home, last_turn, keys_by_root):
            home_url = home = None  # the same session key, another conversation: no history of its own to keep
        home_cost = next((cost for replica, _, cost in options if replica is home), None)
        placing = bool(tokens) and uncached_cost is None  # a placement of a conversation (PD's decode legs aside)
        tip = self._conversation_tip(request, keys_by_root) if placing else None
        conversation_home = self.conversations.home_of(tip)
        per_conversation = self._per_homed_conversation(candidates, cheapest) if placing else 0.0
        long_work = self._long_work(cheapest) if placing else 0.0
        clean = self._without_long_work(candidates, long_work) if long_work and cheapest >= long_work else 0
        best: tuple[float, bool, int, int, int] | None = None
        best_option = options[0]
        best_load_s = 0.0
        for option in options:
            replica, held, cost = option
            # Loads from the tiers are paid once, by this request; computing is paid again by everyone queued
            # behind it, and a moved session's recomputed history is what its home would have saved.
            extra = config.recompute_weight * (cost - cheapest)
            if home_cost is not None and replica.url != home_url:
                extra += config.session_recompute_weight * max(0.0, cost - home_cost)
            load_s = rates.load_seconds(replica, held[1], held[2]) if held and (held[1] or held[2]) else 0.0
            waited_s = min(replica.pending_load_s, replica.load.tier_load_deadline_s) if load_s else 0.0
            if clean and self.prefill_ahead(replica) < long_work:
                extra += config.long_prompt_weight * cost / clean  # one of `clean` replicas short prompts wait least on
            if per_conversation:  # the conversations it would be home to, this one included
                extra += per_conversation * (self.conversations.homed(replica.url) + (replica.url != conversation_home))
            seconds = (self._queue_cost(replica) + cost + extra) * rates.s_per_token_of(replica) + waited_s + load_s
            # A tie keeps a session home; equal replicas (e.g. idle ones for a new conversation) take turns: the least
            # recently chosen wins.
            rank = (
                seconds,
                replica.url != home_url,
                -_tokens_of(held),
                replica.in_flight,
                self._last_chosen.get(replica.url, -1),
            )
            if best is None or rank < best:
                best, best_option, best_load_s = rank, option, load_s
        replica, held, cost = best_option
        split = _split_of(held)
        chosen = Decision(
            replica,
            split.total if split is not None else None,
            split,
            cost,
            best_load_s,
            prefill_ahead=self.prefill_ahead(replica),
            running=_running(replica),
            homed=self.conversations.homed(replica.url),
        )
        self._last_chosen[replica.url] = next(self._decisions)
        prompt_keys = keys_by_root[self._root(request, replica)] if tokens else None
        keys = prompt_keys.all() if prompt_keys is not None else []
        if request.session_key:
            half = (len(keys) - 1) // 2  # the middle of the prompt's full blocks
            self._remember_session(request.session_key, SessionTurn(replica.url, keys[half] if keys else None, half))
        if tokens:
            # A blended prompt's blocks after its cached prefix are never cached: nothing to bridge until they are.
            chosen.keys = keys
            if prompt_keys is not None and replica.url in blends:
                chosen.keys = keys[: _tokens_of(held) // prompt_keys.block_size]
            if placing and prompt_keys is not None:
                full_blocks = (len(tokens) - 1) // prompt_keys.block_size  # the blocks the engine can keep
                self.conversations.record(tip, keys[full_blocks - 1] if full_blocks else None, replica.url, now, cost)
            store = self.shared_stores.get(replica.shared_store_id)
            if store is not None:
                store.used(keys)
        return chosen

    def _conversation_tip(self, request: RouteRequest, keys_by_root: dict[Any, PromptKeys]) -> bytes | None:
        """The remembered tip of the conversation this prompt continues (conversations), if any."""
        full_blocks = len(request.token_ids or ()) - 1
        for prompt_keys in {id(keys): keys for keys in keys_by_root.values()}.values():
            tip = self.conversations.find(prompt_keys.all(), full_blocks // prompt_keys.block_size)
            if tip is not None:
                return tip
        return None

    def _long_work(self, work: float) -> float:
        """The prefill work from which a prompt counts as long: `long_prompt_factor` times the median work of the
        prompts placed so far (a running estimate, moved 2 % of itself toward each new prompt's work)."""
        if self.config.long_prompt_tokens:
            return float(self.config.long_prompt_tokens)
        if not self.config.long_prompt_factor:
            return 0.0
        median = self.work_median
        self.work_median = work if median is None else median * (1.02 if work > median else 0.98)
        return self.config.long_prompt_factor * (median if median is not None else work)

    def _without_long_work(self, candidates: list[Replica], long_work: float) -> int:
        """The replicas with less than a long prompt's prefill work queued: where short prompts wait least."""
        return sum(self.prefill_ahead(replica) < long_work for replica in candidates)

    def _per_homed_conversation(self, candidates: list[Replica], cheapest: float) -> float:
        """What a placement commits beyond this request, per conversation at home on the replica: the
        conversation's later turns queue behind theirs. In prefill-token equivalents: the chance that one has a
        request under way (the router's requests in flight over the live conversations, at most 1), times a turn's
        work (recent continuing turns', else this request's), times the turns a conversation is expected to bring
        yet, times `conversation_weight`. Nothing when no conversation lives or nothing is in flight."""
        conversations, weight = self.conversations, self.config.conversation_weight
        homed = sum(conversations.homed(replica.url) for replica in candidates)
        if not homed or not weight:
            return 0.0
        active = min(1.0, sum(replica.in_flight for replica in candidates) / homed)
        return weight * conversations.future_turns() * active * (conversations.turn_work or cheapest)

    def _fleet_view(self, candidates: list[Replica], now: float) -> _FleetView:
        fleet = self._fleet
        if fleet is None or fleet.candidates is not candidates or now - fleet.made_at > RATES_TTL_S:
            fleet = self._fleet = _FleetView(
                candidates, set(candidates), {r.url: r for r in candidates}, self.fleet_rates(candidates), now
            )
        return fleet

    def _shortlist(
        self,
        request: RouteRequest,
        fleet: _FleetView,
        keys_by_root: dict[Any, PromptKeys],
        home_url: str | None,
    ) -> list[Replica]:
        """The replicas a large fleet's decision scores: a few of those holding the prompt's longest cached prefix
        (the fleet's key -> holders index walks the prompt's keys once), a couple holding its first block, the
        session's last replica, and a random sample of the fleet for load. Whoever holds the most of the prompt is
        among them; an idle replica very likely is (power of d choices)."""
        picked: dict[int, Replica] = {}
        everyone, draw = fleet.candidates, self.rng.random
        for _ in range(RANDOM_SAMPLE):  # with replacement: the fleet is large
            replica = everyone[int(draw() * len(everyone))]
            picked[id(replica)] = replica
        home = fleet.by_url.get(home_url) if home_url is not None else None
        if home is not None:
            picked[id(home)] = home
        prompt_keys = self._prompt_keys(request, everyone[0], keys_by_root)
        if self.holders is not None and prompt_keys is not None and request.token_ids:
            max_blocks = (len(request.token_ids) - 1) // prompt_keys.block_size
            first, deepest = self.holders.along(prompt_keys.all()[:max_blocks])
            # Holders of a deeper key hold the first one too: when as many hold both, they are the same replicas.
            groups = [(deepest, DEEPEST_HOLDERS)]
            if len(first) > len(deepest):
                groups.append((first, FIRST_BLOCK_HOLDERS))
            for group, count in groups:
                for replica in self._sample_of(group, count, fleet):
                    if replica in fleet.allowed:
                        picked[id(replica)] = replica
        return list(picked.values())

    def _sample_of(self, group: Collection[Replica], count: int, fleet: _FleetView) -> Collection[Replica]:
        """Up to `count` random members of `group`, in time that does not grow with the group: a large group (a
        prefix most replicas hold) is sampled by drawing replicas from the fleet and keeping its members."""
        if len(group) <= count:
            return group
        if len(group) <= SMALL_GROUP:
            return self.rng.sample(tuple(group), count)
        members: dict[int, Replica] = {}
        everyone, draw = fleet.candidates, self.rng.random
        for _ in range(MAX_DRAWS):
            replica = everyone[int(draw() * len(everyone))]
            if replica in group:
                members[id(replica)] = replica
                if len(members) == count:
                    break
        return members.values()

    def predicted_cached_tokens(self, request: RouteRequest, replica: Replica) -> int | None:
        """Prompt tokens `replica` holds, as `choose` predicts them (no decision is recorded)."""
        if not request.token_ids:
            return None
        split = self._cached_split(request, replica, {}, time.monotonic(), self.fleet_rates([replica]))
        return split.total if split is not None else None

    def fleet_rates(self, replicas: list[Replica]) -> TierRates:
        """The fleet's medians of what replicas report: seconds per prefill token (the configured guess until one
        reports), and load seconds per block from local tiers and the shared store (for replicas yet to load). A
        fleet of several engines (kvyard's and vLLM's, say) has one speed per engine: the median of its replicas'
        (for vLLM's, the router's own measurement, ttft_fit)."""
        guess = self.config.prefill_s_per_token
        by_kind: dict[str, float] = {}
        kinds = {replica.kind for replica in replicas}
        if len(kinds) > 1:
            for kind in kinds:
                by_kind[kind] = _median([r.load.prefill_s_per_token for r in replicas if r.kind == kind]) or guess
        return TierRates(
            _median([r.load.prefill_s_per_token for r in replicas]) or guess,
            _median([r.load.local_tier_s_per_block for r in replicas]),
            _median([r.load.shared_tier_s_per_block for r in replicas]),
            by_kind,
        )

    def _continues(
        self, request: RouteRequest, home: Replica, last: SessionTurn, keys_by_root: dict[Any, PromptKeys]
    ) -> bool:
        """The request's prompt starts with at least half of the session's last prompt: a next turn of the same
        conversation (its end may differ: a template that drops old reasoning, a trace's last partial block). A
        session key shared by many conversations (one `user` for a whole service) is not one: keeping it on one
        replica would pile every conversation there."""
        if last.middle_key is None:
            return True  # nothing to compare with: the key is taken at its word
        prompt_keys = self._prompt_keys(request, home, keys_by_root)
        if prompt_keys is None or last.middle_index >= prompt_keys.num_blocks:
            return False
        return prompt_keys.key(last.middle_index) == last.middle_key

    def _remember_session(self, session_key: str, turn: SessionTurn) -> None:
        self._last_replica[session_key] = turn
        self._last_replica.move_to_end(session_key)
        if len(self._last_replica) > self.config.max_sessions:
            self._last_replica.popitem(last=False)

    def prefill_cost(self, num_new: int, num_cached: int) -> float:
        pairs = num_new * num_cached + num_new * num_new / 2
        return num_new + self.config.attention_pair_cost * pairs

    def _cached_split(
        self,
        request: RouteRequest,
        replica: Replica,
        keys_by_root: dict[Any, PromptKeys],
        now: float,
        rates: TierRates,
    ) -> CachedSplit | None:
        return _split_of(self._tokens_held(request, replica, keys_by_root, now, rates))

    def _tokens_held(
        self,
        request: RouteRequest,
        replica: Replica,
        keys_by_root: dict[Any, PromptKeys],
        now: float,
        rates: TierRates,
    ) -> tuple[int, int, int] | None:
        """Prompt tokens the replica holds, by source, as the engine finds them: the device cache's prefix, then
        (one load) what its own tiers continue it with, then what the shared store does, as far as its loader gets
        before the deadline once the loads routed there ahead of this one are done. None when the prompt has no
        keys to look up."""
        prompt_keys = self._prompt_keys(request, replica, keys_by_root)
        if prompt_keys is None:
            return None
        max_blocks = (len(request.token_ids or ()) - 1) // prompt_keys.block_size  # the last token is computed
        keys = prompt_keys.all()
        index = replica.index
        exact, routed, in_tiers = index.exact, index.routed, index.local
        device = local = shared = 0
        if exact is not None and not routed:  # the common case of a replica with events: one set to look in
            while device < max_blocks and keys[device] in exact:
                device += 1
        else:
            while device < max_blocks:  # index.holds(), inlined
                key = keys[device]
                if not ((exact is not None and key in exact) or (key in routed and index.holds(key, now))):
                    break
                device += 1
        if in_tiers:
            while device + local < max_blocks and keys[device + local] in in_tiers:
                local += 1
        store = self.shared_stores.get(replica.shared_store_id) if replica.load.shared_tier_available else None
        if store is not None:
            while device + local + shared < max_blocks and store.holds(keys[device + local + shared], now):
                shared += 1
        if local or shared:
            local, shared = rates.loadable(replica, local, shared)
        size = prompt_keys.block_size
        return device * size, local * size, shared * size

    def _moved_tokens_saved(
        self, request: RouteRequest, replica: Replica, windows: dict[bytes, PromptWindows], cached: int
    ) -> int:
        """Prompt tokens a replica that blends would not compute beyond the `cached` ones: the moved text it holds
        after them, less the fraction it recomputes (0 unless the request blends there: its non_prefix_reuse, else
        the replica's default)."""
        advert, tokens = replica.blend, request.token_ids
        if advert is None or not tokens or (request.body.get("non_prefix_reuse") or advert.default) != "blend":
            return 0
        root, size = self._root(request, replica)
        prompt = windows.get(root)
        if prompt is None:
            prompt = windows[root] = PromptWindows.of(prompt_fingerprints(tokens, root, size), size)
        matched = replica.index.segments.matched_tokens(prompt, cached)
        if matched < advert.min_reused_fraction * (len(tokens) - cached):
            return 0  # too little for the replica to blend
        return int(matched * (1.0 - advert.recompute_fraction))

    def queue_cost(self, replica: Replica) -> float:
        """The work ahead of a new request on `replica`, in prefill-token equivalents."""
        return self._queue_cost(replica)

    def _queue_cost(self, replica: Replica) -> float:
        return self.prefill_ahead(replica) + _running(replica) * self.running_cost(replica)

    def running_cost(self, replica: Replica) -> float:
        """How much a running request slows a new prefill there, in prefill tokens: the configured figure (kvyard's
        engine), or for another engine's replica what its first-token times say (ttft_fit)."""
        if replica.kind != KVYARD:
            fitted = replica.ttft.running_cost
            if fitted is not None:
                return fitted
        return self.config.running_request_cost

    def prefill_ahead(self, replica: Replica) -> float:
        """The prefill work queued on `replica` (what a new prompt's prefill waits for when running decodes share
        its steps, as chunked prefill has them), in prefill-token equivalents."""
        # Waiting requests the report counts and the router knows are not waiting (any more) are not ahead.
        load = replica.load
        external_waiting = max(0, load.num_waiting - replica.awaiting_first_byte - replica.first_bytes_since_load)
        return replica.pending_prefill_cost + external_waiting * self.config.waiting_request_cost

    def _root(self, request: RouteRequest, replica: Replica) -> tuple[bytes, int]:
        namespace = replica.namespace
        if namespace is None:
            model = str(request.body.get("model") or (replica.model_ids[0] if replica.model_ids else ""))
            namespace = KeyNamespace(model, "router-approx", "", self.config.approx_block_size)
        elif replica.lora_ids and request.body.get("model") in replica.lora_ids:
            namespace = dataclasses.replace(namespace, model_name=request.body["model"])  # an adapter's own blocks
        # The salt the replica will use: the request's, combined with the router's key salt when the replica splits
        # its cache by caller key (the router is its caller).
        salt = tenant_salt(replica.salt_key, request.cache_salt, per_key=replica.salt_key is not None)
        root = self._roots.get((namespace, salt))
        if root is None:
            if len(self._roots) > 4096:
                self._roots.clear()
            root = self._roots[(namespace, salt)] = namespace.with_salt(salt).root_key()
        return root, namespace.block_size

    def _prompt_keys(
        self, request: RouteRequest, replica: Replica, keys_by_root: dict[Any, PromptKeys]
    ) -> PromptKeys | None:
        """The prompt's keys in the replica's namespace, computed once per decision and namespace (`keys_by_root`
        lives for one decision, so the namespace object's identity can stand for its root meanwhile)."""
        if request.token_ids is None:
            return None
        same_namespace = (id(replica.namespace), replica.salt_key) if replica.namespace is not None else None
        prompt_keys = keys_by_root.get(same_namespace)
        if prompt_keys is None:
            root = self._root(request, replica)
            prompt_keys = keys_by_root.get(root)
            if prompt_keys is None:
                prompt_keys = keys_by_root[root] = PromptKeys.of(root[0], root[1], request.token_ids)
            if same_namespace is not None:
                keys_by_root[same_namespace] = prompt_keys
        return prompt_keys


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """Where a session's last request went, and the key of the middle one of its prompt's full blocks there."""

    url: str
    middle_key: bytes | None
    middle_index: int


@dataclass(slots=True)
class _FleetView:
    """Lookups over one large candidate list (the registry's, the same object until a replica changes state)."""

    candidates: list[Replica]
    allowed: set[Replica]
    by_url: dict[str, Replica]
    rates: TierRates
    made_at: float


@dataclass(frozen=True, slots=True)
class TierRates:
    """What time is worth in one decision: seconds per prefill token, and the fleet's load seconds per block by
    medium (0: nobody has measured it yet)."""

    s_per_token: float
    local_s_per_block: float = 0.0
    shared_s_per_block: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)  # seconds per prefill token, in a mixed fleet

    def s_per_token_of(self, replica: Replica) -> float:
        return self.by_kind.get(replica.kind, self.s_per_token) if self.by_kind else self.s_per_token

    def per_block(self, replica: Replica) -> tuple[float, float]:
        """The replica's load seconds per block (local, shared): its own figure, else the fleet's, else what
        computing a block costs (no gain is promised for a tier nobody has measured); its own tiers are taken to be
        no slower than the shared store until they are measured."""
        block_size = replica.namespace.block_size if replica.namespace is not None else 1
        unmeasured = block_size * self.s_per_token_of(replica)
        load = replica.load
        shared = load.shared_tier_s_per_block or self.shared_s_per_block or unmeasured
        return load.local_tier_s_per_block or self.local_s_per_block or shared, shared

    def loadable(self, replica: Replica, local: int, shared: int) -> tuple[int, int]:
        """Of `local` then `shared` blocks in the replica's tiers, those its loader brings before the deadline,
        which each block brought pushes back by the replica's reported extension (the engine's LoadDeadline)."""
        load = replica.load
        deadline = load.tier_load_deadline_s
        if deadline <= 0 or not (local or shared):
            return local, shared
        local_s, shared_s = self.per_block(replica)
        extension = load.tier_load_extension_s_per_block
        budget = deadline - replica.pending_load_s
        in_time = _blocks_in_time(local, budget, local_s, extension)
        if in_time < local:
            return in_time, 0
        return local, _blocks_in_time(shared, budget + local * (extension - local_s), shared_s, extension)

    def load_seconds(self, replica: Replica, local_tokens: int, shared_tokens: int) -> float:
        """Time to load that many tokens' blocks from the replica's own tiers and from the shared store."""
        block_size = replica.namespace.block_size if replica.namespace is not None else 1
        local_s, shared_s = self.per_block(replica)
        return (local_tokens * local_s + shared_tokens * shared_s) / block_size


def _blocks_in_time(blocks: int, budget_s: float, s_per_block: float, extension_s_per_block: float) -> int:
    """How many of `blocks` arrive while the time spent stays within `budget_s` plus the extension they earn."""
    if budget_s < 0:
        return 0
    if s_per_block <= extension_s_per_block:
        return blocks
    return min(blocks, int(budget_s / (s_per_block - extension_s_per_block)))


def _running(replica: Replica) -> int:
    """Requests decoding there: the streams the router relays, and those the last load report counts beyond the
    router's own requests at that time (other clients'). A report is up to a health interval old: taking it as
    it is would count the router's streams that ended since."""
    others = replica.load.num_running - replica.streaming_at_load - replica.awaiting_at_load
    return replica.streaming + max(0, others)


def _tokens_of(held: tuple[int, int, int] | None) -> int:
    return held[0] + held[1] + held[2] if held is not None else 0


def _split_of(held: tuple[int, int, int] | None) -> CachedSplit | None:
    return CachedSplit(*held) if held is not None else None


def _median(values: list[float]) -> float:
    reported = sorted(value for value in values if value > 0)
    return reported[len(reported) // 2] if reported else 0.0


def make_policy(
    config: RouterConfig, shared_stores: SharedStores | None = None, holders: KeyHolders | None = None
) -> Policy:
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_load":
        return LeastLoad()
    if config.policy == "session":
        return SessionAffinity()
    return CacheAware(config, shared_stores if shared_stores is not None else SharedStores(), holders)

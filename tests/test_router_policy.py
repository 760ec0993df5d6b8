"""The cache_aware policy's choices on hand-built fleet states (no servers: the scoring alone)."""

from __future__ import annotations

from kvyard.router.config import RouterConfig
from kvyard.router.keys import PromptKeys
from kvyard.router.policies import CacheAware, RouteRequest
from kvyard.router.replica import Replica

HISTORY = list(range(1000, 1000 + 2048))  # a conversation's earlier turns, held by replica A
TURN = [*HISTORY, *range(5000, 5128)]


def fleet(policy: CacheAware) -> tuple[Replica, Replica]:
    a, b = Replica("http://a"), Replica("http://b")
    for replica in (a, b):
        replica.index.reset([], seq=0)
    request = RouteRequest("completion", {"model": "m"}, None, HISTORY, None)
    root, block_size = policy._root(request, a)
    a.index.reset(PromptKeys.of(root, block_size, HISTORY).all(), seq=1)
    return a, b


def route(policy: CacheAware, replicas: tuple[Replica, Replica], session: str | None) -> Replica:
    request = RouteRequest("completion", {"model": "m"}, session, TURN, None)
    return policy.choose(request, list(replicas)).replica


def test_cached_history_wins_until_the_queue_outweighs_its_prefill() -> None:
    policy = CacheAware(RouterConfig(recompute_weight=1.0))
    a, b = fleet(policy)
    assert route(policy, (a, b), None) is a
    saved = policy.prefill_cost(len(TURN), 0) - policy.prefill_cost(128, 2048)
    a.pending_prefill_cost = 2.5 * saved  # more queued work than the cache saves, counted twice
    assert route(policy, (a, b), None) is b


def test_a_session_stays_on_the_replica_of_its_last_turn_under_the_same_queue() -> None:
    policy = CacheAware(RouterConfig(recompute_weight=1.0, session_recompute_weight=300.0))
    a, b = fleet(policy)
    assert route(policy, (a, b), "conversation-1") is a  # first turn seen: remembered on A
    saved = policy.prefill_cost(len(TURN), 0) - policy.prefill_cost(128, 2048)
    a.pending_prefill_cost = 2.5 * saved
    assert route(policy, (a, b), "conversation-1") is a
    assert route(policy, (a, b), "conversation-2") is b  # a new session has no home yet
    a.pending_prefill_cost = 400 * saved  # an overloaded home still lets the session go
    assert route(policy, (a, b), "conversation-1") is b


def test_new_conversations_take_turns_over_equal_idle_replicas() -> None:
    policy = CacheAware(RouterConfig())
    replicas = [Replica(f"http://{name}") for name in "abc"]
    for replica in replicas:
        replica.index.reset([], seq=0)
    chosen = []
    for conversation in range(6):
        request = RouteRequest(
            "completion", {"model": "m"}, None, list(range(conversation * 100, conversation * 100 + 64)), None
        )
        chosen.append(policy.choose(request, replicas).replica.url)
    assert chosen == ["http://a", "http://b", "http://c"] * 2

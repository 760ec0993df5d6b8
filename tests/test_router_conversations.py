"""Conversations learned from prompts alone, and what cache_aware does with them."""

from __future__ import annotations

import time

from kvyard.router.config import RouterConfig
from kvyard.router.conversations import PRIOR_CONTINUED, PRIOR_STARTED, LiveConversations
from kvyard.router.policies import CacheAware, RouteRequest
from kvyard.router.replica import Replica

SYSTEM = list(range(1, 513))  # every conversation's shared start


def first_turn(conversation: int) -> list[int]:
    return [*SYSTEM, *range(10_000 * (conversation + 1), 10_000 * (conversation + 1) + 700)]


def route(policy: CacheAware, replicas: list[Replica], tokens: list[int]) -> Replica:
    return policy.choose(RouteRequest("completion", {"model": "m"}, None, tokens, None), replicas).replica


def idle_fleet(names: str) -> list[Replica]:
    replicas = [Replica(f"http://{name}") for name in names]
    for replica in replicas:
        replica.index.reset([], seq=0)
    return replicas


def test_a_next_turn_continues_its_conversation_and_a_new_prompt_starts_one() -> None:
    policy = CacheAware(RouterConfig())
    a, b = idle_fleet("ab")
    conversations = policy.conversations
    route(policy, [a, b], first_turn(0))
    assert (conversations.total, conversations.started, conversations.continued) == (1, 1, 0)
    history = [*first_turn(0), *range(90_000, 90_032)]  # its answer
    for turn in range(1, 4):
        history += list(range(100_000 * turn, 100_000 * turn + 200))
        route(policy, [a, b], history)
    assert (conversations.total, conversations.started, conversations.continued) == (1, 1, 3)
    assert conversations.homed(a.url) + conversations.homed(b.url) == 1  # wherever its turns went
    route(policy, [a, b], first_turn(1))
    assert (conversations.total, conversations.started) == (2, 2)
    # 3 continuations over 2 conversations, with the prior's 4 over 4
    assert conversations.future_turns() == (3 + PRIOR_CONTINUED) / (2 + PRIOR_STARTED)


def test_an_idle_conversation_is_over_after_idle_s() -> None:
    conversations = LiveConversations(idle_s=10.0)
    conversations.record(None, b"tip-1", "http://a", now=100.0)
    conversations.record(None, b"tip-2", "http://a", now=105.0)
    assert conversations.homed("http://a") == 2
    assert conversations.find([b"x", b"tip-1", b"y"], max_blocks=3) == b"tip-1"
    assert conversations.find([b"x", b"tip-1", b"y"], max_blocks=1) is None  # beyond the prompt's full blocks
    conversations.expire(now=112.0)
    assert conversations.homed("http://a") == 1
    assert conversations.find([b"tip-1"], max_blocks=1) is None
    conversations.record(b"tip-2", b"tip-3", "http://b", now=113.0)  # the conversation moved
    assert (conversations.homed("http://a"), conversations.homed("http://b")) == (0, 1)


def crowded_fleet(policy: CacheAware) -> tuple[Replica, Replica]:
    """A is home to six live conversations, B to one, and four requests are under way; B has slightly more work
    queued right now."""
    a, b = idle_fleet("ab")
    now = time.monotonic()
    for number in range(7):
        policy.conversations.record(None, f"tip-{number}".encode(), (a if number < 6 else b).url, now)
    a.pending_prefill_cost, b.pending_prefill_cost = 1000.0, 1200.0
    a.in_flight, b.in_flight = 3, 1
    return a, b


def test_a_new_conversation_goes_where_fewer_conversations_will_come_back() -> None:
    policy = CacheAware(RouterConfig())
    a, b = crowded_fleet(policy)
    assert route(policy, [a, b], first_turn(0)) is b


def test_with_conversation_weight_0_each_request_is_placed_for_itself() -> None:
    policy = CacheAware(RouterConfig(conversation_weight=0.0))
    a, b = crowded_fleet(policy)
    assert route(policy, [a, b], first_turn(0)) is a


def test_an_idle_fleet_places_by_the_request_alone() -> None:
    policy = CacheAware(RouterConfig())
    a, b = crowded_fleet(policy)
    a.pending_prefill_cost = b.pending_prefill_cost = 0.0
    a.in_flight = b.in_flight = 0
    chosen = {route(policy, [a, b], first_turn(number)).url for number in range(2)}
    assert chosen == {a.url, b.url}  # they take turns, whatever the homes

"""The cache_aware policy's choices on hand-built fleet states (no servers: the scoring alone)."""

from __future__ import annotations

import dataclasses
import time

import pytest

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


def pd_fleet(policy: CacheAware) -> list[Replica]:
    """A prefill replica and three decode replicas; decode replica d0 holds HISTORY, all share one namespace."""
    from kvyard.api.load import LoadReport
    from kvyard.kvcache.block_key import KeyNamespace

    namespace = KeyNamespace("m", "digest", "float32", 16)
    replicas = [Replica("http://p", configured_role="prefill")]
    replicas += [Replica(f"http://d{i}", configured_role="decode") for i in range(3)]
    for replica in replicas:
        replica.namespace, replica.load = namespace, LoadReport()
        replica.index.reset([], seq=0)
    request = RouteRequest("completion", {"model": "m"}, None, HISTORY, None)
    root, block_size = policy._root(request, replicas[1])
    replicas[1].index.reset(PromptKeys.of(root, block_size, HISTORY).all(), seq=1)
    return replicas


def test_prefilled_elsewhere_decodes_spread_by_load_not_by_a_held_prefix() -> None:
    from kvyard.router.pd import PDPlanner

    planner = PDPlanner.create(RouterConfig(disaggregation="always"))
    replicas = pd_fleet(planner.decode_policy)
    chosen = []
    for turn in range(6):  # new conversations sharing d0's prefix; each running decode weighs on its replica
        plan = planner.plan(RouteRequest("completion", {"model": "m"}, None, [*HISTORY, turn], None), replicas)
        assert plan.prefill is not None and plan.prefill.replica.url == "http://p"
        plan.decode.replica.streaming += 1
        chosen.append(plan.decode.replica.url)
    assert {chosen.count(url) for url in ("http://d0", "http://d1", "http://d2")} == {2}


def test_conditional_disaggregation_prefills_a_continuing_turn_where_its_history_is() -> None:
    from kvyard.router.pd import PDPlanner

    planner = PDPlanner.create(RouterConfig(disaggregation="conditional", pd_local_prefill_tokens=512))
    replicas = pd_fleet(planner.decode_policy)
    plan = planner.plan(RouteRequest("completion", {"model": "m"}, None, TURN, None), replicas)
    assert (plan.reason, plan.decode.replica.url, plan.prefill) == ("short", "http://d0", None)
    fresh = list(range(9000, 9000 + 2048))  # nobody holds it: prefilled remotely
    plan = planner.plan(RouteRequest("completion", {"model": "m"}, None, fresh, None), replicas)
    assert plan.reason == "remote" and plan.prefill is not None


def test_conditional_disaggregation_prefills_locally_when_the_prefill_pool_is_backed_up() -> None:
    from kvyard.router.pd import PDPlanner

    planner = PDPlanner.create(RouterConfig(disaggregation="conditional", pd_local_prefill_tokens=512))
    replicas = pd_fleet(planner.decode_policy)
    fresh = RouteRequest("completion", {"model": "m"}, None, list(range(9000, 9000 + 2048)), None)
    prefill_work = planner.decode_policy.prefill_cost(2048, 0)
    replicas[0].pending_prefill_cost = 1.5 * prefill_work  # the prefill replica has more queued than this prompt
    plan = planner.plan(fresh, replicas)
    assert (plan.reason, plan.prefill) == ("prefill_busy", None)
    assert plan.decode.prefill_cost == prefill_work  # the decode replica's queue now counts this prefill
    for decoder in replicas[1:]:
        decoder.streaming = 1  # a stream runs on every decode replica: a local prefill would hold it up a little
        decoder.pending_prefill_cost = 0.0
    assert planner.plan(fresh, replicas).reason == "prefill_busy"  # within the budget (16,384 tokens)
    for decoder in replicas[1:]:
        decoder.pending_prefill_cost = 15_000.0  # prefills already queued there: this one would pass the budget
    assert planner.plan(fresh, replicas).reason == "remote"
    strict = PDPlanner.create(RouterConfig(disaggregation="conditional", pd_decode_prefill_budget=0))
    for decoder in replicas[1:]:
        decoder.pending_prefill_cost = 0.0
    assert strict.plan(fresh, replicas).reason == "remote"  # budget 0: a replica that decodes never prefills
    for decoder in replicas[1:]:
        decoder.streaming = 0
    assert strict.plan(fresh, replicas).reason == "prefill_busy"  # an idle one still may


def test_a_decode_replica_without_kv_room_is_passed_over_and_a_full_decode_pool_runs_on_a_prefill_replica() -> None:
    from kvyard.api.load import LoadReport
    from kvyard.router.pd import PDPlanner

    planner = PDPlanner.create(RouterConfig(disaggregation="conditional", pd_local_prefill_tokens=512))
    replicas = pd_fleet(planner.decode_policy)
    fresh = RouteRequest("completion", {"model": "m", "max_tokens": 100}, None, list(range(9000, 9000 + 2048)), None)
    for replica in replicas:
        replica.load = LoadReport(kv_blocks_total=256)  # 4,096 tokens in 16-token blocks
    for decoder in replicas[1:3]:
        decoder.load = LoadReport(kv_blocks_total=256, tokens_in_flight=3000)  # 1,096 free: 2,148 do not fit
    plan = planner.plan(fresh, replicas)
    assert (plan.reason, plan.decode.replica.url, plan.decode.kv_tokens) == ("remote", "http://d2", 2148)
    replicas[3].pending_kv_tokens = 2000  # requests the router just sent there fill it too
    plan = planner.plan(fresh, replicas)
    assert (plan.reason, plan.decode.replica.url, plan.prefill) == ("decode_full", "http://p", None)
    always = PDPlanner.create(RouterConfig(disaggregation="always"))
    assert always.plan(fresh, replicas).reason == "remote"  # always-disaggregate never runs it whole
    replicas[0].load = LoadReport(kv_blocks_total=256, tokens_in_flight=3000)
    assert planner.plan(fresh, replicas).reason == "remote"  # no room anywhere: disaggregated as before
    for replica in replicas:
        replica.load, replica.pending_kv_tokens = LoadReport(), 0  # no pool reported: room is assumed
    assert planner.plan(fresh, replicas).reason == "remote"


# ---------------------------------------------------------------------------- the KV tier (docs/contracts.md §7)

TIER_NAMESPACE_BLOCK = 16


def tiered_fleet(policy: CacheAware, store_id: str = "store-1") -> tuple[Replica, Replica, list[bytes]]:
    """Two replicas reporting a host tier and a shared store; A's device cache holds nothing yet."""
    from kvyard.api.load import LoadReport
    from kvyard.kvcache.block_key import KeyNamespace

    namespace = KeyNamespace("m", "digest", "float32", TIER_NAMESPACE_BLOCK)
    a, b = Replica("http://a"), Replica("http://b")
    for replica in (a, b):
        replica.namespace, replica.shared_store_id = namespace, store_id
        replica.load = LoadReport(prefill_s_per_token=1e-4, local_tier_s_per_block=1e-4, shared_tier_s_per_block=1e-3)
        replica.index.reset([], seq=0)
    policy.shared_stores.joined(store_id, None)
    request = RouteRequest("completion", {"model": "m"}, None, HISTORY, None)
    root, block_size = policy._root(request, a)
    return a, b, PromptKeys.of(root, block_size, HISTORY).all()


def split_of(policy: CacheAware, replica: Replica) -> dict[str, int]:
    request = RouteRequest("completion", {"model": "m"}, None, TURN, None)
    split = policy._cached_split(request, replica, {}, 0.0, policy.fleet_rates([replica]))
    assert split is not None
    return split.as_dict()


def test_predicted_cached_tokens_follow_the_engine_device_then_own_tiers_then_shared_store() -> None:
    policy = CacheAware(RouterConfig())
    a, b, keys = tiered_fleet(policy)
    a.index.reset(keys[:10], seq=1, local_keys=keys[5:40])  # the device prefix ends at block 10
    policy.shared_stores.joined("store-1", None).stored(keys[:100], now=0.0)
    assert split_of(policy, a) == {"device": 160, "local": 480, "shared": 960}
    assert split_of(policy, b) == {"device": 0, "local": 0, "shared": 1600}
    a.load = dataclasses.replace(a.load, shared_tier_available=False)  # its store fails: no shared hits there
    assert split_of(policy, a) == {"device": 160, "local": 480, "shared": 0}
    b.shared_store_id = "another-store"
    assert split_of(policy, b) == {"device": 0, "local": 0, "shared": 0}


def test_shared_store_entries_expire_with_its_ttl_and_go_when_the_store_is_cleared() -> None:
    policy = CacheAware(RouterConfig())
    *_, keys = tiered_fleet(policy)
    store = policy.shared_stores.joined("store-1", ttl_s=30.0)
    store.stored(keys, now=100.0)
    assert store.holds(keys[0], now=129.0) and not store.holds(keys[0], now=131.0)
    store.stored(keys, now=100.0)
    policy.shared_stores.cleared("store-1", "store-2")  # flushed: nothing of store-1 is left
    assert policy.shared_stores.get("store-1") is None and len(policy.shared_stores.joined("store-2", None)) == 0


def test_a_session_moves_to_an_idle_replica_when_loading_its_history_costs_less_than_its_home_queue() -> None:
    policy = CacheAware(RouterConfig(recompute_weight=1.0, session_recompute_weight=300.0))
    a, b, keys = tiered_fleet(policy)
    a.index.reset(keys, seq=1)
    assert route(policy, (a, b), "conversation-1") is a
    a.pending_prefill_cost = 4 * policy.prefill_cost(len(TURN), 0)  # four full prompts queued at home
    assert route(policy, (a, b), "conversation-1") is a  # without the shared store, moving means recomputing
    policy.shared_stores.joined("store-1", None).stored(keys, now=time.monotonic())
    assert route(policy, (a, b), "conversation-1") is b  # with it, the history loads on the idle replica
    b.load = dataclasses.replace(b.load, shared_tier_s_per_block=1.0)  # a store this slow is not worth it
    a.pending_prefill_cost = 4 * policy.prefill_cost(len(TURN), 0)
    assert route(policy, (a, b), "conversation-2") is a


def test_predicted_tier_hits_stop_where_the_replicas_loader_reaches_its_deadline() -> None:
    policy = CacheAware(RouterConfig())
    a, _, keys = tiered_fleet(policy)
    policy.shared_stores.joined("store-1", None).stored(keys, now=0.0)
    a.load = dataclasses.replace(a.load, tier_load_deadline_s=0.05)  # 50 blocks at 1 ms each
    assert split_of(policy, a)["shared"] == 50 * TIER_NAMESPACE_BLOCK
    a.pending_load_s = 0.03  # loads routed there before this one take most of the time
    assert split_of(policy, a)["shared"] == 20 * TIER_NAMESPACE_BLOCK
    a.load = dataclasses.replace(a.load, shared_tier_s_per_block=0.0)  # never measured: priced as computing
    assert split_of(policy, a)["shared"] == int(0.02 / (TIER_NAMESPACE_BLOCK * 1e-4)) * TIER_NAMESPACE_BLOCK


def test_each_block_a_load_brings_pushes_the_predicted_deadline_back_as_the_replica_reports() -> None:
    policy = CacheAware(RouterConfig())
    a, _, keys = tiered_fleet(policy)
    policy.shared_stores.joined("store-1", None).stored(keys, now=0.0)
    a.load = dataclasses.replace(a.load, tier_load_deadline_s=0.01)  # 10 blocks at 1 ms each without an extension
    assert split_of(policy, a)["shared"] == 10 * TIER_NAMESPACE_BLOCK
    a.load = dataclasses.replace(a.load, tier_load_extension_s_per_block=0.0005)  # each block nets 0.5 ms
    assert split_of(policy, a)["shared"] == 20 * TIER_NAMESPACE_BLOCK
    a.load = dataclasses.replace(a.load, tier_load_extension_s_per_block=0.001)  # as fast as the extension: all
    assert split_of(policy, a)["shared"] == len(HISTORY)  # every block the store holds
    a.pending_load_s = 0.02  # past the deadline before it starts: nothing, however fast
    assert split_of(policy, a)["shared"] == 0


def test_negative_pd_token_settings_are_refused_naming_the_flag() -> None:
    import pytest

    with pytest.raises(ValueError, match="--pd-local-prefill-tokens must be 0 or more, got -1"):
        RouterConfig(pd_local_prefill_tokens=-1)
    with pytest.raises(ValueError, match="--pd-decode-prefill-budget must be 0 or more, got -1"):
        RouterConfig(pd_decode_prefill_budget=-1)


def test_a_session_key_shared_by_many_conversations_keeps_none_of_them_home() -> None:
    """One `user` for a whole service is not a conversation: a request that does not continue the key's last
    prompt is not held on that prompt's replica (every conversation would pile up there); the prefix it shares
    still counts as any cached prefix does."""
    policy = CacheAware(RouterConfig(recompute_weight=1.0, session_recompute_weight=300.0))
    a, b = fleet(policy)  # a holds HISTORY, which both conversations start with (a shared system prompt)
    first, other = [*HISTORY, *range(10_000, 14_096)], [*HISTORY, *range(20_000, 24_096)]
    a.pending_prefill_cost = 10.0
    assert policy.choose(RouteRequest("completion", {"model": "m"}, "service", first, None), [a, b]).replica is a
    a.pending_prefill_cost = 3 * policy.prefill_cost(len(HISTORY), 0)  # more queued than the shared prefix saves
    assert policy.choose(RouteRequest("completion", {"model": "m"}, "service", other, None), [a, b]).replica is b
    a.pending_prefill_cost = 10.0
    assert policy.choose(RouteRequest("completion", {"model": "m"}, "chat", first, None), [a, b]).replica is a
    a.pending_prefill_cost = 3 * policy.prefill_cost(len(HISTORY), 0)
    follow_up = [*first, *range(30_000, 30_100)]  # continues the key's last prompt: its history stays home
    assert policy.choose(RouteRequest("completion", {"model": "m"}, "chat", follow_up, None), [a, b]).replica is a


def _idle_fleet(names: str) -> list[Replica]:
    replicas = [Replica(f"http://{name}") for name in names]
    for replica in replicas:
        replica.index.reset([], seq=0)
    return replicas


def _prompt(first: int, length: int) -> RouteRequest:
    return RouteRequest("completion", {"model": "m"}, None, list(range(first, first + length)), None)


def test_a_long_prompt_joins_long_work_and_leaves_an_idle_replica_to_short_prompts() -> None:
    """Three replicas: one computing a long prompt (20k tokens queued), one with a short one, one idle. A long
    prompt goes to the idle one by least predicted TTFT alone; charged for taking one of the replicas short prompts
    wait least on, it joins the long work instead, and the next short prompt still finds the idle replica."""
    long_work, short_work = 20_000.0, 1_000.0

    def loaded() -> list[Replica]:
        busy_long, busy_short, idle = _idle_fleet("abc")
        busy_long.pending_prefill_cost, busy_short.pending_prefill_cost = long_work, short_work
        return [busy_long, busy_short, idle]

    plain = CacheAware(RouterConfig(conversation_weight=0.0))
    assert plain.choose(_prompt(10_000, 30_000), loaded()).replica.url == "http://c"
    charged = CacheAware(RouterConfig(conversation_weight=0.0, long_prompt_tokens=16_000, long_prompt_weight=4.0))
    replicas = loaded()
    assert charged.choose(_prompt(10_000, 30_000), replicas).replica.url == "http://a"
    assert charged.choose(_prompt(90_000, 500), replicas).replica.url == "http://c"


def test_a_long_prompt_still_takes_an_idle_replica_when_the_long_queue_is_too_long() -> None:
    replicas = _idle_fleet("ab")
    replicas[0].pending_prefill_cost = 200_000.0
    charged = CacheAware(RouterConfig(conversation_weight=0.0, long_prompt_tokens=16_000, long_prompt_weight=1.0))
    assert charged.choose(_prompt(10_000, 30_000), replicas).replica.url == "http://b"


@pytest.mark.parametrize("name", ["long_prompt_tokens", "long_prompt_weight"])
def test_long_prompt_settings_are_refused_below_zero_naming_the_flag(name: str) -> None:
    with pytest.raises(ValueError, match=f"--{name.replace('_', '-')}"):
        RouterConfig(**{name: -1})


def test_long_is_relative_to_the_prompts_placed_so_far() -> None:
    """With --long-prompt-factor, what counts as long follows the running median of placed prompts' work: after
    short prompts a 30k-token one is long (it joins the long work); after 30k-token prompts, one more is not."""

    def placed_after(first_length: int) -> str:
        policy = CacheAware(RouterConfig(conversation_weight=0.0, long_prompt_factor=8.0, long_prompt_weight=4.0))
        for index in range(40):
            policy.choose(_prompt(1_000_000 + 100_000 * index, first_length), _idle_fleet("xy"))
        busy_long, idle = _idle_fleet("ab")
        busy_long.pending_prefill_cost = 20_000.0
        return policy.choose(_prompt(10_000, 30_000), [busy_long, idle]).replica.url

    assert placed_after(500) == "http://a"
    assert placed_after(30_000) == "http://b"

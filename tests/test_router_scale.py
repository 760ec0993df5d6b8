"""The router over large fleets: the fleet-wide key -> holders index stays equal to what the replicas' indexes
hold, and `cache_aware` over hundreds of replicas scores a shortlist that still finds the cache and spreads load."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvyard.api.load import LoadReport
from kvyard.router.cache_index import CacheIndex
from kvyard.router.config import RouterConfig
from kvyard.router.holders import KeyHolders
from kvyard.router.keys import PromptKeys
from kvyard.router.metrics import RouterMetrics
from kvyard.router.policies import DEEPEST_HOLDERS, FIRST_BLOCK_HOLDERS, RANDOM_SAMPLE, CacheAware, RouteRequest
from kvyard.router.registry import Registry
from kvyard.router.replica import Replica, State


def indexes_sharing(holders: KeyHolders, count: int) -> list[CacheIndex]:
    indexes = [CacheIndex(routed_capacity=8, routed_ttl_s=1.0, holders=holders) for _ in range(count)]
    for number, index in enumerate(indexes):
        index.owner = number
    return indexes


def test_the_holders_index_equals_the_replicas_indexes_through_random_changes() -> None:
    rng = random.Random(7)
    holders = KeyHolders()
    indexes = indexes_sharing(holders, 4)
    keys = [bytes([k]) * 16 for k in range(24)]
    seqs = [0] * len(indexes)
    for step in range(3000):
        at = rng.randrange(len(indexes))
        index, some = indexes[at], rng.sample(keys, rng.randrange(1, 6))
        action = rng.choice(
            ["stored", "removed", "local_stored", "local_removed", "routed", "expire", "reset", "clear", "forget"]
        )
        if index.exact is None and action in ("stored", "removed", "local_stored", "local_removed", "clear"):
            action = "reset"
        seqs[at] += 1
        if action in ("stored", "removed"):
            index.apply(seqs[at], action, some)
        elif action.startswith("local_"):
            index.apply(seqs[at], action.removeprefix("local_"), some, medium="local")
        elif action == "routed":
            index.note_routed(some, now=float(step))
        elif action == "expire":  # a lookup long after the routed entries' time: they expire
            for key in some:
                index.holds(key, now=float(step) + 10.0)
        elif action == "reset":
            index.reset(rng.sample(keys, 5), seqs[at], rng.sample(keys, 2))
        elif action == "clear":
            index.clear()
        else:
            index.forget_events()
        for key in keys:
            expected = {number for number, other in enumerate(indexes) if other.holds_anywhere(key)}
            assert set(holders.of(key)) == expected, (step, action, key)
    assert len(holders) == sum(1 for key in keys if holders.of(key))


def large_fleet(count: int, holders: KeyHolders, rng: random.Random) -> list[Replica]:
    replicas = [Replica(f"http://10.0.0.{i}:8000", index=CacheIndex(holders=holders)) for i in range(count)]
    for replica in replicas:
        replica.index.owner = replica
        replica.index.reset([], seq=0)
        replica.load = LoadReport(num_running=rng.randrange(8))
    return replicas


def test_a_session_finds_its_replica_among_three_hundred() -> None:
    rng = random.Random(0)
    holders = KeyHolders()
    replicas = large_fleet(300, holders, rng)
    policy = CacheAware(RouterConfig(), holders=holders)
    system = [rng.randrange(3, 30000) for _ in range(64)]
    for number, replica in enumerate(replicas):  # every replica holds the system prompt; one each a history
        history = [*system, *(rng.randrange(3, 30000) for _ in range(256))]
        request = RouteRequest("completion", {"model": "m"}, None, history, None)
        root, block_size = policy._root(request, replica)
        replica.index.apply(1, "stored", PromptKeys.of(root, block_size, history).all())
        if number == 123:
            wanted_history, holder = history, replica
    turn = [*wanted_history, *(rng.randrange(3, 30000) for _ in range(16))]
    decision = policy.choose(RouteRequest("completion", {"model": "m"}, None, turn, None), replicas)
    assert decision.replica is holder
    assert decision.predicted_cached_tokens == len(wanted_history)
    shortlist = policy._shortlist(
        RouteRequest("completion", {"model": "m"}, None, turn, None), policy._fleet_view(replicas, 0.0), {}, None
    )
    assert holder in shortlist
    assert len(shortlist) <= DEEPEST_HOLDERS + FIRST_BLOCK_HOLDERS + RANDOM_SAMPLE + 1


def test_new_prompts_spread_over_a_large_idle_fleet_and_follow_load() -> None:
    rng = random.Random(1)
    holders = KeyHolders()
    replicas = large_fleet(400, holders, rng)
    for replica in replicas:
        replica.load = LoadReport(num_running=0)
    busy = set(rng.sample(replicas, 200))
    for replica in busy:
        replica.load = LoadReport(num_running=64)
    policy = CacheAware(RouterConfig(), holders=holders)
    chosen: Counter[str] = Counter()
    for _ in range(400):
        prompt = [rng.randrange(3, 30000) for _ in range(128)]
        chosen[policy.choose(RouteRequest("completion", {"model": "m"}, None, prompt, None), replicas).replica.url] += 1
    assert len(chosen) > 100  # spread, not piled onto a few
    on_busy = sum(count for url, count in chosen.items() if any(r.url == url for r in busy))
    # A random sample of 4 misses every idle replica with probability 1/16 when half are busy.
    assert on_busy < 400 * (0.5**RANDOM_SAMPLE) * 2, on_busy
    assert math.isclose(sum(chosen.values()), 400)


def test_a_small_fleet_is_scored_in_full() -> None:
    rng = random.Random(2)
    holders = KeyHolders()
    replicas = large_fleet(RouterConfig().full_scan_replicas, holders, rng)
    policy = CacheAware(RouterConfig(), holders=holders)
    for replica in replicas:
        replica.load = LoadReport(num_running=50)
    idle = replicas[37]
    idle.load = LoadReport(num_running=0)
    for _ in range(20):  # a full scan always finds the one idle replica; a sample of 4 rarely would
        prompt = [rng.randrange(3, 30000) for _ in range(64)]
        assert policy.choose(RouteRequest("completion", {"model": "m"}, None, prompt, None), replicas).replica is idle


def test_health_checks_of_a_large_fleet_are_spread_out() -> None:
    registry = Registry(RouterConfig(), RouterMetrics())
    registry.replicas = {f"http://10.0.0.{i}:8000": Replica(f"http://10.0.0.{i}:8000") for i in range(1000)}
    intervals = [registry._health_interval_s() for _ in range(100)]
    assert all(3.75 <= interval <= 6.25 for interval in intervals)  # 1,000 / 200 checks per second, +-25%
    assert len(set(intervals)) > 50
    registry.replicas = dict(list(registry.replicas.items())[:100])
    assert registry._health_interval_s() == RouterConfig().health_interval_s


def test_a_replica_answering_requests_is_not_also_asked_for_its_health() -> None:
    """While traffic flows the requests are the health checks; an idle or ejected replica is asked (a real server on
    loopback counts the /health calls)."""
    asked: list[str] = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def scenario() -> None:
        registry = Registry(RouterConfig(), RouterMetrics())
        replica = Replica(f"http://127.0.0.1:{server.server_address[1]}")
        await registry._health_only(replica, 2.0)
        assert asked == ["/health"]
        replica.answered_at = time.monotonic()
        await registry._health_only(replica, 2.0)
        assert asked == ["/health"]  # it answered a request since the last check
        replica.state = State.EJECTED
        await registry._health_only(replica, 2.0)
        replica.state, replica.answered_at = State.HEALTHY, time.monotonic() - RouterConfig().health_interval_s
        await registry._health_only(replica, 2.0)
        assert asked == ["/health"] * 3
        replica.http.close()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()
        server.server_close()


def test_a_replica_being_removed_leaves_the_routable_list_at_once() -> None:
    async def scenario() -> None:
        registry = Registry(RouterConfig(), RouterMetrics())
        stays, goes = Replica("http://10.0.0.1:8000"), Replica("http://10.0.0.2:8000")
        registry.replicas = {stays.url: stays, goes.url: goes}
        assert registry.routable() == [stays, goes]
        seen_meanwhile: list[list[Replica]] = []

        async def slow_to_stop() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen_meanwhile.append(registry.routable())  # decisions made while remove() awaits its tasks
                raise

        registry._tasks[goes.url] = [asyncio.create_task(slow_to_stop())]
        await asyncio.sleep(0)
        await registry.remove(goes.url)
        assert seen_meanwhile == [[stays]] and registry.routable() == [stays]

    asyncio.run(scenario())


def test_replicas_that_come_and_go_reuse_bits_and_a_newcomer_inherits_no_keys() -> None:
    holders = KeyHolders()
    staying, key, other_key = Replica("http://staying:8000"), b"k" * 16, b"o" * 16
    holders.add(key, staying)
    for turn in range(100):
        leaving = Replica(f"http://leaving-{turn}:8000")
        holders.add(key, leaving)
        holders.add(other_key, leaving)
        assert set(holders.of(key)) == {staying, leaving}
        holders.discard(key, leaving)
        holders.discard(other_key, leaving)
        holders.retire(leaving)
    newcomer = Replica("http://newcomer:8000")
    holders.add(other_key, newcomer)
    assert set(holders.of(key)) == {staying}
    assert set(holders.of(other_key)) == {newcomer}
    assert holders.mask_bits == 2

"""The routed entries of a replica's cache index: held while their request waits, expiring after its first byte."""

from __future__ import annotations

import math

from kvyard.router.cache_index import CacheIndex
from kvyard.router.holders import KeyHolders

KEYS = [bytes([k]) * 16 for k in range(6)]


def index_with_events() -> CacheIndex:
    index = CacheIndex(routed_ttl_s=5.0, holders=KeyHolders(), owner="replica")
    index.reset([], seq=0)
    return index


def test_routed_entries_wait_for_the_first_byte_then_live_their_ttl() -> None:
    index = index_with_events()
    batch = index.note_routed(KEYS[:4], math.inf)
    assert all(index.holds(key, now=1e9) for key in KEYS[:4])  # queued however long: still held
    index.stamp(batch, now=100.0)
    assert index.holds(KEYS[0], now=104.0)
    assert not index.holds(KEYS[0], now=105.5)
    assert not index.holds(KEYS[1], now=105.5)
    assert not index.holders.of(KEYS[0]) and "replica" in index.holders.of(KEYS[2])  # released once expired


def test_a_later_request_keeps_the_keys_it_shares_with_an_earlier_one() -> None:
    index = index_with_events()
    first = index.note_routed(KEYS[:4], math.inf)
    second = index.note_routed(KEYS[2:6], math.inf)
    index.stamp(first, now=10.0)
    assert not index.holds(KEYS[0], now=20.0)
    assert index.holds(KEYS[2], now=20.0) and index.holds(KEYS[5], now=20.0)  # the second still waits
    index.stamp(second, now=30.0)
    assert index.holds(KEYS[3], now=34.0) and not index.holds(KEYS[3], now=36.0)


def test_evicted_blocks_drop_the_entries_of_answered_requests_only() -> None:
    index = index_with_events()
    answered = index.note_routed(KEYS[:2], now=50.0)
    index.note_routed(KEYS[2:4], math.inf)
    index.stamp(answered, now=51.0)
    index.apply(1, "stored", KEYS[:4])
    index.apply(2, "removed", KEYS[:4])
    assert [index.holds(key, now=52.0) for key in KEYS[:4]] == [False, False, True, True]
    assert list(index.holders.of(KEYS[0])) == [] and list(index.holders.of(KEYS[3])) == ["replica"]

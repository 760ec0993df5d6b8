"""BlockPool + KVCacheManager: accounting under random workloads, LRU eviction order, prefix lookup.

The stateful test keeps a shadow copy of what each physical block holds (the token ids written into
it by simulated forward passes), so besides the pool's own bookkeeping it checks the property that
matters to the model: a prefix-cache hit always hands out a block holding exactly the hit tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.scheduling.block_pool import BlockPool, BlockPoolError
from kvyard.engine.scheduling.kv_cache_manager import KVCacheManager
from kvyard.engine.scheduling.request import Request
from kvyard.kvcache.block_key import chain_block_keys
from kvyard.kvcache.events import KVEventLog

BS = 4
ROOT = b"r" * 16
# Shared prefixes over a tiny alphabet, so that random prompts hit the prefix cache often, including
# prompts that are exactly a cached prefix (whole blocks, all cached).
PREFIXES = (
    (1, 2, 3, 4),
    (1, 2, 3, 4, 5, 6, 7, 8),
    (1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4),
    (1, 2, 3, 4, 9, 9, 9, 9),
    (0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
)
prompts = st.one_of(
    st.sampled_from(PREFIXES).map(list),
    st.builds(
        lambda prefix, tail: list(prefix) + tail,
        st.sampled_from(PREFIXES),
        st.lists(st.integers(0, 2), min_size=1, max_size=6),
    ),
    st.lists(st.integers(0, 2), min_size=1, max_size=9),
)


def make_request(request_id: str, prompt: list[int], block_size: int = BS) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=64),
        cache_root_key=ROOT,
        block_size=block_size,
    )


def ref_counts(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def replay_events(log: KVEventLog) -> set[bytes]:
    """Replay the whole log (asserting gap-free sequence numbers); returns the keys it says are cached."""
    events, complete = log.events_since(0)
    assert complete
    assert [e.seq for e in events] == list(range(1, log.last_seq + 1))
    cached: set[bytes] = set()
    for event in events:
        for key in event.block_keys:
            if event.kind == "stored":
                assert key not in cached, "stored twice without a removal in between"
                cached.add(key)
            else:
                assert event.kind == "removed"
                assert key in cached, "removed a key that was never stored"
                cached.remove(key)
    return cached


class PrefixCacheMachine(RuleBasedStateMachine):
    """Admit / compute / free / preempt requests against one pool, as the scheduler would."""

    @initialize(num_blocks=st.integers(3, 14))
    def setup(self, num_blocks: int) -> None:
        self.events = KVEventLog()
        self.pool = BlockPool(num_blocks, enable_caching=True, events=self.events)
        self.kv = KVCacheManager(self.pool, BS)
        self.waiting: list[Request] = []  # holds no blocks (new or preempted)
        self.live: list[Request] = []  # holds blocks; every token in its table is computed
        self.shadow: dict[int, list[int | None]] = {}  # block id -> token ids written into it
        self.block_tokens: dict[bytes, tuple[int, ...]] = {}  # block key -> the tokens it stands for
        self.next_id = 0

    # ------------------------------------------------------------------ helpers

    def _learn_keys(self, request: Request) -> None:
        for index, key in enumerate(request.block_keys):
            tokens = tuple(request.all_token_ids[index * BS : (index + 1) * BS])
            assert self.block_tokens.setdefault(key, tokens) == tokens, "one key for two contents"

    def _compute(self, request: Request, num_new: int, next_token: int) -> None:
        """Simulate a forward pass writing KV for `num_new` tokens, then sample if it reached the end."""
        start = request.num_computed_tokens
        for position in range(start, start + num_new):
            block = request.block_table[position // BS]
            assert self.pool.ref_count(block) == 1, "writing KV into a block another request shares"
            self.shadow[block][position % BS] = request.all_token_ids[position]
        request.num_computed_tokens += num_new
        self.kv.register_computed_blocks(request)
        assert len(request.block_table) == -(-request.num_computed_tokens // BS)
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(next_token)
            self._learn_keys(request)

    def _fresh_blocks(self, request: Request, first_new: int) -> None:
        for block in request.block_table[first_new:]:
            self.shadow[block] = [None] * BS

    def _assert_unchanged(self, before: list[int], request: Request, table: list[int]) -> None:
        assert ref_counts(self.pool) == before
        assert request.block_table == table

    # ------------------------------------------------------------------ rules

    @rule(prompt=prompts, chunk=st.integers(1, 12), next_token=st.integers(0, 2))
    def arrive(self, prompt: list[int], chunk: int, next_token: int) -> None:
        request = make_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        assert request.block_keys == chain_block_keys(ROOT, prompt, BS)
        self._learn_keys(request)
        self.waiting.append(request)
        self._try_admit(request, chunk, next_token)

    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 12), next_token=st.integers(0, 2))
    def admit(self, pick: int, chunk: int, next_token: int) -> None:
        if self.waiting:
            self._try_admit(self.waiting[pick % len(self.waiting)], chunk, next_token)

    def _try_admit(self, request: Request, chunk: int, next_token: int) -> None:
        assert request.block_table == [] and request.num_computed_tokens == 0
        cached = self.kv.find_cached_prefix(request)
        num_cached = len(cached) * BS
        assert num_cached < request.num_tokens, "the last token must always be left to compute"
        assert len(set(cached)) == len(cached)
        for index, block in enumerate(cached):
            # The heart of prefix caching: a hit hands out a block holding exactly these tokens.
            assert self.shadow[block] == request.all_token_ids[index * BS : (index + 1) * BS]
        num_new = min(chunk, request.num_tokens - num_cached)
        before = ref_counts(self.pool)
        if not self.kv.allocate_slots(request, num_new, cached):
            self._assert_unchanged(before, request, [])
            needed = -(-(num_cached + num_new) // BS) - len(cached)
            revived = sum(1 for b in cached if before[b] == 0)
            assert needed + revived > self.pool.num_free_blocks
            return
        assert request.block_table[: len(cached)] == cached
        assert request.num_registered_blocks == len(cached)
        self._fresh_blocks(request, len(cached))
        request.num_computed_tokens = num_cached
        self.waiting.remove(request)
        self.live.append(request)
        self._compute(request, num_new, next_token)

    @rule(pick=st.integers(0, 1000), chunk=st.integers(1, 12), next_token=st.integers(0, 2))
    def step(self, pick: int, chunk: int, next_token: int) -> None:
        if self.live:
            self._step(self.live[pick % len(self.live)], chunk, next_token)

    @rule(chunk=st.integers(1, 12), next_token=st.integers(0, 2))
    def step_all(self, chunk: int, next_token: int) -> None:
        for request in list(self.live):
            self._step(request, chunk, next_token)

    def _step(self, request: Request, chunk: int, next_token: int) -> None:
        remaining = request.num_tokens - request.num_computed_tokens
        assert remaining >= 1
        num_new = min(chunk, remaining)
        before, table = ref_counts(self.pool), list(request.block_table)
        if not self.kv.allocate_slots(request, num_new):
            self._assert_unchanged(before, request, table)
            needed = -(-(request.num_computed_tokens + num_new) // BS) - len(table)
            assert needed > self.pool.num_free_blocks
            return
        assert request.block_table[: len(table)] == table
        self._fresh_blocks(request, len(table))
        self._compute(request, num_new, next_token)

    @rule(pick=st.integers(0, 1000))
    def finish(self, pick: int) -> None:
        if not self.live:
            return
        request = self.live.pop(pick % len(self.live))
        self.kv.free(request)
        assert request.block_table == [] and request.num_registered_blocks == 0

    @rule(pick=st.integers(0, 1000))
    def preempt(self, pick: int) -> None:
        if not self.live:
            return
        request = self.live.pop(pick % len(self.live))
        self.kv.free(request)
        request.reset_for_recompute()
        self.waiting.append(request)

    @rule(pick=st.integers(0, 1000), roll=st.integers(0, 2))
    def abort_waiting(self, pick: int, roll: int) -> None:
        if not self.waiting or roll:  # rarer than the other rules
            return
        request = self.waiting.pop(pick % len(self.waiting))
        before = ref_counts(self.pool)
        self.kv.free(request)  # holds nothing: must be a no-op
        assert ref_counts(self.pool) == before

    @rule(roll=st.integers(0, 7))
    def reset_prefix_cache(self, roll: int) -> None:
        if roll:  # rare: it wipes out the cache hits the other rules build up
            return
        before = ref_counts(self.pool)
        self.pool.reset_prefix_cache()
        assert self.pool.num_cached_blocks == 0
        assert self.pool.cached_block_keys() == []
        assert ref_counts(self.pool) == before

    @rule(block=st.integers(0, 1000), roll=st.integers(0, 2))
    def double_free_is_refused(self, block: int, roll: int) -> None:
        if roll:
            return
        free_blocks = [b for b in range(self.pool.num_blocks) if self.pool.ref_count(b) == 0]
        if not free_blocks:
            return
        target = free_blocks[block % len(free_blocks)]
        before, num_free = ref_counts(self.pool), self.pool.num_free_blocks
        with pytest.raises(BlockPoolError):
            self.pool.free([target])
        assert ref_counts(self.pool) == before
        assert self.pool.num_free_blocks == num_free

    # ------------------------------------------------------------------ invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == self.pool.num_blocks

    @invariant()
    def references_match_block_tables(self) -> None:
        holders = [0] * self.pool.num_blocks
        for request in self.live:
            assert len(set(request.block_table)) == len(request.block_table), "block twice in one table"
            for block in request.block_table:
                holders[block] += 1
        for request in self.waiting:
            assert request.block_table == []
        assert ref_counts(self.pool) == holders
        assert sum(ref_counts(self.pool)) == sum(len(r.block_table) for r in self.live)
        assert self.pool.num_used_blocks == sum(1 for h in holders if h > 0)

    @invariant()
    def cache_map_is_consistent(self) -> None:
        keys = self.pool.cached_block_keys()
        blocks = []
        for key in keys:
            block = self.pool.lookup(key)
            assert block is not None
            assert self.pool._block_keys[block] == key
            # Cached blocks (in use or free) still hold the content their key stands for.
            assert tuple(self.shadow[block]) == self.block_tokens[key]
            blocks.append(block)
        assert len(set(blocks)) == len(blocks), "two keys share one block"

    @invariant()
    def free_queue_prefers_uncached(self) -> None:
        seen_cached = False
        for block in self.pool._free:
            is_cached = self.pool._block_keys[block] is not None
            assert not (seen_cached and not is_cached), "an uncached block queued behind a cached one"
            seen_cached = seen_cached or is_cached

    @invariant()
    def events_mirror_cache(self) -> None:
        assert replay_events(self.events) == set(self.pool.cached_block_keys())


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------------------------- unit tests


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free([blocks[0]])
    with pytest.raises(BlockPoolError):
        pool.free([3])  # never allocated
    pool.check_invariants()
    assert pool.num_free_blocks == 4


def test_shared_block_needs_one_free_per_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.register(block, b"k" * 16)
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(BlockPoolError):
        pool.free([block])


def test_over_allocation_and_double_registration_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    a, b = pool.allocate(2)
    assert pool.register(a, b"a" * 16)
    assert not pool.register(b, b"a" * 16), "a key already cached must not be taken by another block"
    with pytest.raises(BlockPoolError):
        pool.register(a, b"x" * 16)
    assert pool.lookup(b"a" * 16) == a
    pool.check_invariants()


def test_caching_disabled_registers_nothing() -> None:
    events = KVEventLog()
    pool = BlockPool(4, enable_caching=False, events=events)
    kv = KVCacheManager(pool, BS)
    request = make_request("a", list(range(9)))
    assert kv.allocate_slots(request, 9)
    request.num_computed_tokens = 9
    kv.register_computed_blocks(request)
    assert pool.num_cached_blocks == 0 and events.last_seq == 0
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []


def test_pool_rejects_non_positive_size() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(0)


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    keys = [bytes([i]) * 16 for i in range(2)]
    pool.register(blocks[0], keys[0])
    pool.register(blocks[1], keys[1])
    pool.free(blocks)  # cached ones freed first, yet uncached ones must go first
    first = pool.allocate(2)
    assert set(first) == {blocks[2], blocks[3]}
    assert set(pool.cached_block_keys()) == set(keys)
    # Then the least recently freed cached block.
    assert pool.allocate(1) == [blocks[0]]
    assert pool.cached_block_keys() == [keys[1]]


def test_most_recently_freed_cached_block_survives_longest() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    keys = [bytes([i]) * 16 for i in range(3)]
    for block, key in zip(blocks, keys):
        pool.register(block, key)
    for block in (blocks[1], blocks[0], blocks[2]):
        pool.free([block])
    # A cache hit on blocks[1] and a release make it the most recently used again.
    pool.touch([blocks[1]])
    pool.free([blocks[1]])
    evicted = [pool.allocate(1)[0] for _ in range(3)]
    assert evicted == [blocks[0], blocks[2], blocks[1]]
    assert pool.num_cached_blocks == 0


def test_tail_blocks_of_a_freed_request_are_evicted_before_its_prefix() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(100, 113))  # 3 full blocks + 1 partial
    request = make_request("a", prompt)
    assert kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.register_computed_blocks(request)
    table = list(request.block_table)
    assert pool.num_cached_blocks == 3
    kv.free(request)
    # The uncached partial block and the 4 never-used blocks go first, ...
    assert set(pool.allocate(5)) == {table[3], *(b for b in range(8) if b not in table)}
    assert pool.num_cached_blocks == 3
    assert pool.allocate(1) == [table[2]]  # ... then the tail of the cached prefix
    again = make_request("b", prompt)
    assert kv.find_cached_prefix(again) == table[:2]
    assert pool.allocate(1) == [table[1]]
    assert kv.find_cached_prefix(again) == table[:1]


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_find_cached_prefix_leaves_a_token_when_prompt_is_whole_blocks(num_blocks_in_prompt: int) -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(num_blocks_in_prompt * BS))
    first = make_request("a", prompt)
    assert kv.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.register_computed_blocks(first)
    assert pool.num_cached_blocks == num_blocks_in_prompt
    second = make_request("b", prompt)
    hit = kv.find_cached_prefix(second)
    assert hit == first.block_table[: num_blocks_in_prompt - 1]
    assert len(hit) * BS < second.num_tokens
    # One token longer: now every cached block is usable.
    third = make_request("c", [*prompt, 7])
    assert kv.find_cached_prefix(third) == first.block_table


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=24), block_size=st.integers(1, 5))
def test_find_cached_prefix_always_leaves_a_token(prompt: list[int], block_size: int) -> None:
    pool = BlockPool(64)  # room for both requests: the second needs new blocks past the hit
    kv = KVCacheManager(pool, block_size)
    first = make_request("a", prompt, block_size)
    assert kv.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    kv.register_computed_blocks(first)
    second = make_request("b", prompt, block_size)
    hit = kv.find_cached_prefix(second)
    assert len(hit) == (len(prompt) - 1) // block_size
    assert len(hit) * block_size <= len(prompt) - 1
    assert kv.allocate_slots(second, len(prompt) - len(hit) * block_size, hit)
    assert second.block_table[: len(hit)] == first.block_table[: len(hit)]
    pool.check_invariants()


def test_allocate_slots_failure_changes_nothing() -> None:
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    holder = make_request("a", list(range(8)))
    assert kv.allocate_slots(holder, 8)
    holder.num_computed_tokens = 8
    kv.register_computed_blocks(holder)
    kv.free(holder)  # both blocks now free but cached
    big = make_request("b", [*range(8), 0, 0, 0, 0, 0])
    cached = kv.find_cached_prefix(big)
    assert cached == [pool.lookup(k) for k in holder.block_keys]
    pinned = make_request("c", [5, 5, 5, 5])
    assert kv.allocate_slots(pinned, 4)  # takes the one uncached block
    # Now: reviving 2 cached blocks + 2 new blocks = 4 > the 2 free (cached) blocks.
    before = ref_counts(pool)
    assert not kv.allocate_slots(big, big.num_tokens - len(cached) * BS, cached)
    assert ref_counts(pool) == before
    assert big.block_table == [] and big.num_registered_blocks == 0
    pool.check_invariants()


def test_events_record_store_and_evict() -> None:
    events = KVEventLog()
    pool = BlockPool(2, events=events)
    kv = KVCacheManager(pool, BS)
    request = make_request("a", list(range(9)))
    assert kv.allocate_slots(request, 8)
    request.num_computed_tokens = 8
    kv.register_computed_blocks(request)
    stored = [e for e in events.events_since(0)[0] if e.kind == "stored"]
    assert [k for e in stored for k in e.block_keys] == request.block_keys[:2]
    kv.free(request)
    pool.allocate(1)  # evicts the tail block (freed first)
    assert replay_events(events) == {request.block_keys[0]}
    pool.reset_prefix_cache()
    assert replay_events(events) == set()

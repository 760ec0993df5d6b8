"""Per-request view of the block pool: prefix-cache lookup, slot allocation, block registration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvyard.engine.block_pool import BlockPool
from kvyard.engine.request import Request


class BlockTier(Protocol):
    """A lower KV tier below the device pool (see kv_tier_link.KVTierLink)."""

    def fetch(self, root_key: bytes, keys: Sequence[bytes]) -> Sequence[Any]: ...

    def install(self, block_ids: Sequence[int], blocks: Sequence[Any]) -> None: ...

    def offload(self, root_key: bytes, keys: Sequence[bytes], block_ids: Sequence[int]) -> None: ...


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, tier: BlockTier | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tier = tier
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0
        self.num_tier_hit_tokens = 0  # of those, loaded from the lower tier

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix; the last token is always left to compute,
        since its logits are needed to sample."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for key in request.block_keys[:max_blocks]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            blocks.append(block_id)
        if self.tier is not None and len(blocks) < max_blocks:
            blocks.extend(self._load_from_tier(request, blocks, max_blocks))
        return blocks

    def _load_from_tier(self, request: Request, device_blocks: list[int], max_blocks: int) -> list[int]:
        """Continue a device-cache prefix from the lower tier into newly allocated, registered blocks.

        They are left unreferenced but cached, exactly like device hits, for allocate_slots to take."""
        assert self.tier is not None
        self.pool.touch(device_blocks)  # so allocating for the loaded blocks cannot evict them
        loaded: list[int] = []
        try:
            keys = request.block_keys[len(device_blocks) : max_blocks][: self.pool.num_free_blocks]
            fetched = self.tier.fetch(request.cache_root_key, keys)
            loaded = self.pool.allocate(len(fetched))
            self.tier.install(loaded, fetched)
            self.pool.register_blocks(loaded, keys)
        finally:
            self.pool.free(reversed(device_blocks + loaded))
        self.num_tier_hit_tokens += len(loaded) * self.block_size
        return loaded

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens after its computed (and newly
        cached) ones. Returns False, changing nothing, when the pool cannot supply them."""
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        blocks_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, blocks_needed - len(request.block_table) - len(cached_blocks))
        if not num_new_blocks and not cached_blocks:  # a decode step inside its last block: nothing to do
            return True
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_table.extend(cached_blocks)
            request.num_registered_blocks = len(request.block_table)
        request.block_table.extend(self.pool.allocate(num_new_blocks))
        return True

    def register_computed_blocks(self, request: Request) -> None:
        """Enter every full, computed block of `request` into the prefix cache."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_keys))
        start = request.num_registered_blocks
        if num_full <= start:
            return
        registered = self.pool.register_blocks(request.block_table[start:num_full], request.block_keys[start:num_full])
        request.num_registered_blocks = num_full
        if self.tier is not None and registered:
            self.tier.offload(request.cache_root_key, [key for _, key in registered], [b for b, _ in registered])

    def free(self, request: Request) -> None:
        # Tail blocks first, so they are evicted before the shared-prefix blocks.
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        request.num_registered_blocks = 0

"""The scheduler's half of the connector: which blocks of which request to load from the tier, and which to save.

Blocks are named by kvyard's chained block keys over the request's token ids, in a namespace of the model's weights,
its dtype, the block size and the request's cache salt, so a block another replica (or this one before a restart)
saved is found by content, never by vLLM's per-process hashes. A request is offered the leading full blocks the
tiers hold past what vLLM's own prefix cache found, never its last token (vLLM must compute at least one). Every
full block a step computes is saved once, unless the tier had it when the request arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvyard.integrations.tier_presence import Source, TierPresence
from kvyard.kvcache.block_key import KeyNamespace, chain_block_keys


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Blocks of one request moved between the tier and vLLM's paged cache: a load fills vLLM's blocks `block_ids`
    from the tier's `keys` before the step's forward; a save gives the tier those blocks after it."""

    request_id: str
    root_key: bytes
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    block_indexes: tuple[int, ...]  # each block's position in the request


@dataclass(slots=True)
class StepPlan:
    loads: list[BlockCopy] = field(default_factory=list)
    saves: list[BlockCopy] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request in a step: how many of its tokens have KV once the step's forward is done."""

    request_id: str
    computed_after_step: int


@dataclass(slots=True)
class RequestBlocks:
    """One request's chained block keys as far as its tokens go, and how far the tier has them."""

    root_key: bytes
    keys: list[bytes] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in the tier, or were in vLLM's cache when the request arrived
    offered: tuple[int, list[Source]] = (0, [])  # the last lookup: first block, sources of the blocks offered
    load: tuple[int, int] | None = None  # (first block, count) to load at the request's next step

    def extend(self, token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
        if len(self.keys) >= num_blocks:
            return
        parent = self.keys[-1] if self.keys else self.root_key
        start = len(self.keys) * block_size
        self.keys += chain_block_keys(parent, list(token_ids[start : num_blocks * block_size]), block_size)


class BlockPlanner:
    def __init__(self, namespace: KeyNamespace, presence: TierPresence, *, load: bool, save: bool) -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.presence = presence
        self.load_enabled = load
        self.save_enabled = save
        self._requests: dict[str, RequestBlocks] = {}
        self._roots: dict[str, bytes] = {}

    def matched_tokens(self, request_id: str, cache_salt: str, token_ids: Sequence[int], num_computed: int) -> int:
        """Tokens the tier can give `request_id` beyond the `num_computed` (block-aligned) vLLM has already."""
        state = self._requests.get(request_id) or self._track(request_id, cache_salt)
        first = num_computed // self.block_size
        loadable = (len(token_ids) - 1) // self.block_size
        if not self.load_enabled or num_computed % self.block_size or first >= loadable:
            state.offered = (first, [])
            return 0
        state.extend(token_ids, self.block_size, loadable)
        sources = self.presence.leading(state.keys[first:loadable])
        state.offered = (first, sources)
        return len(sources) * self.block_size

    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        """vLLM gave the request blocks, `num_external_tokens` of them to fill from the tier."""
        state = self._requests.get(request_id)
        if state is None:
            return
        first, sources = state.offered
        count = min(num_external_tokens // self.block_size, len(sources))
        state.load = (first, count) if count else None
        state.saved = max(state.saved, first + count)

    def sources(self, request_id: str, num_external_tokens: int) -> list[Source]:
        """Where the blocks of the last lookup come from (for vLLM's hit-by-source counters)."""
        state = self._requests.get(request_id)
        return state.offered[1][: num_external_tokens // self.block_size] if state else []

    def plan_step(
        self,
        scheduled: Sequence[ScheduledRequest],
        token_ids_of: Callable[[str], Sequence[int]],
        block_ids_of: Callable[[str], Sequence[int]],
    ) -> StepPlan:
        plan = StepPlan()
        for request in scheduled:
            state = self._requests.get(request.request_id)
            if state is None:
                continue
            if state.load is not None:
                plan.loads.append(self._load(request.request_id, state, block_ids_of(request.request_id)))
                state.load = None
            if self.save_enabled:
                save = self._save(request, state, token_ids_of, block_ids_of)
                if save is not None:
                    plan.saves.append(save)
        return plan

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _track(self, request_id: str, cache_salt: str) -> RequestBlocks:
        root = self._roots.get(cache_salt)
        if root is None:
            root = self._roots[cache_salt] = self.namespace.with_salt(cache_salt).root_key()
        state = self._requests[request_id] = RequestBlocks(root)
        return state

    def _load(self, request_id: str, state: RequestBlocks, block_ids: Sequence[int]) -> BlockCopy:
        assert state.load is not None
        first, count = state.load
        end = first + count
        return BlockCopy(
            request_id,
            state.root_key,
            tuple(state.keys[first:end]),
            tuple(block_ids[first:end]),
            tuple(range(first, end)),
        )

    def _save(
        self,
        request: ScheduledRequest,
        state: RequestBlocks,
        token_ids_of: Callable[[str], Sequence[int]],
        block_ids_of: Callable[[str], Sequence[int]],
    ) -> BlockCopy | None:
        full = request.computed_after_step // self.block_size
        if full <= state.saved:
            return None
        token_ids = token_ids_of(request.request_id)
        full = min(full, len(token_ids) // self.block_size)
        state.extend(token_ids, self.block_size, full)
        block_ids = block_ids_of(request.request_id)
        chosen = [
            index
            for index in range(state.saved, min(full, len(block_ids)))
            if not self.presence.held_locally(state.keys[index])
        ]
        state.saved = max(state.saved, full)
        if not chosen:
            return None
        keys = tuple(state.keys[index] for index in chosen)
        self.presence.expect(keys)
        return BlockCopy(
            request.request_id, state.root_key, keys, tuple(block_ids[index] for index in chosen), tuple(chosen)
        )

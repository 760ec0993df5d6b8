"""What the connector's tier holds, told in vLLM's own KV events, so a router that follows a vLLM replica's events
(`kvyard route --replica-events`) sees the replica's tier as it sees its device cache.

A block the worker's own tiers (memory, disk) gained is announced as vLLM's `BlockStored` with medium `KVYARD`,
under the block hash, parent hash, tokens and extra keys vLLM's events give the same block on the device; one
they lost, as `BlockRemoved`. The scheduler learns each block's identity when it plans the block's load or save,
and announces it once the worker reports the tier has it. Blocks on disk from before a restart are not announced.

A block the worker's writer put into the shared store (Redis) is announced again with medium `KVYARD_SHARED`: every
replica that loads from that store can take it (which store it is, the replica's metrics say: vllm_metrics). The
store's own expiry and evictions are not seen here; the router expires entries with the store's TTL.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys

if TYPE_CHECKING:
    from vllm.v1.request import Request

MEDIUM = "KVYARD"
SHARED_MEDIUM = "KVYARD_SHARED"  # the shared store the replica's connector writes to (vllm_metrics names it)
MAX_PENDING = 1 << 16  # identities of planned blocks the worker has not reported yet (a dropped write never is)


@dataclass(frozen=True, slots=True)
class BlockIdentity:
    block_hash: Any
    parent_hash: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None


def identity(request: Request, index: int, block_size: int) -> BlockIdentity | None:
    """Block `index` of `request` as vLLM's events name it; None before vLLM has hashed it."""
    hashes = request.block_hashes
    if index >= len(hashes):
        return None
    start, end = index * block_size, (index + 1) * block_size
    extra, _ = generate_block_hash_extra_keys(request, start, end, 0)
    lora = request.lora_request
    return BlockIdentity(
        maybe_convert_block_hash(hashes[index]),
        maybe_convert_block_hash(hashes[index - 1]) if index else None,
        list(request.all_token_ids[start:end]),
        lora.adapter_id if lora else None,
        lora.name if lora else None,
        to_event_extra_keys([extra]),
    )


class TierEvents:
    """`local`: the connector has tiers of its own (memory, disk), announced with medium MEDIUM; `shared`: it writes
    to a shared store, announced with medium SHARED_MEDIUM."""

    def __init__(self, block_size: int, local: bool = True, shared: bool = False) -> None:
        self.block_size = block_size
        self._saved_to = {medium for medium, used in ((MEDIUM, local), (SHARED_MEDIUM, shared)) if used}
        self._loaded_to = {MEDIUM} if local else set[str]()
        # Planned blocks not announced yet in every medium they go to: identity, media still to announce.
        self._pending: OrderedDict[bytes, tuple[BlockIdentity, set[str]]] = OrderedDict()
        self._held: dict[str, dict[bytes, Any]] = {MEDIUM: {}, SHARED_MEDIUM: {}}  # medium -> key -> vLLM's hash
        self._events: list[KVCacheEvent] = []

    def planned(self, request: Request, keys: Iterable[tuple[int, bytes]], saved: bool = False) -> None:
        """The step loads or (`saved`) saves these blocks (index in the request, key) of `request`. A loaded block
        reaches the replica's own tiers; a saved one, the shared store too."""
        media = self._saved_to if saved else self._loaded_to
        for index, key in keys:
            if key in self._pending:
                continue
            media_left = {medium for medium in media if key not in self._held[medium]}
            if not media_left:
                continue
            block = identity(request, index, self.block_size)
            if block is not None:
                self._pending[key] = (block, media_left)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def reported(self, stored: Iterable[bytes], removed: Iterable[bytes], snapshot: bool = False) -> None:
        """The worker's tiers gained `stored` and lost `removed` (`snapshot`: they hold `stored` and nothing else,
        which the worker says when it lost track; what was announced and is not in it is withdrawn)."""
        if snapshot:
            kept = set(stored)
            removed = [key for key in self._held[MEDIUM] if key not in kept]
        self._announce(MEDIUM, stored, removed)

    def reported_shared(self, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """The worker's writer put `stored` into the shared store, and saw `removed` leave it."""
        self._announce(SHARED_MEDIUM, stored, removed)

    def _announce(self, medium: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        held = self._held[medium]
        for key in stored:
            entry = self._pending.get(key)
            if entry is None or key in held or medium not in entry[1]:
                continue
            block, media_left = entry
            media_left.discard(medium)
            if not media_left:
                del self._pending[key]
            held[key] = block.block_hash
            self._events.append(
                BlockStored(
                    block_hashes=[block.block_hash],
                    parent_block_hash=block.parent_hash,
                    token_ids=block.token_ids,
                    block_size=self.block_size,
                    lora_id=block.lora_id,
                    medium=medium,
                    lora_name=block.lora_name,
                    extra_keys=block.extra_keys,
                )
            )
        gone = [block_hash for key in removed if (block_hash := held.pop(key, None)) is not None]
        if gone:
            self._events.append(BlockRemoved(block_hashes=gone, medium=medium))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

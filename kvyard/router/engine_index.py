"""One vLLM or SGLang replica's cache index, kept from the engine's own KV events.

The engine names blocks by its own hashes, which depend on its hash function and seed; the router names them
by kvyard's block keys, computed from the events' token ids under the replica's namespace, so that its lookups
use the same keys as for any other replica and never depend on the engine's seed. This keeps the map from each
engine hash to its kvyard key: a stored block whose parent the router never saw (an event lost, or stored
before the router joined) cannot be keyed and is counted, not guessed. Blocks whose hash covers more than
tokens, a LoRA and a cache salt (images, prompt embeddings) are not keyed either.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvyard.api.engine_kv_events import AllCleared, EngineEvent, EngineHash, RemovedBlocks, StoredBlocks
from kvyard.kvcache.block_key import KeyNamespace, chain_encoded_keys, encode_tokens
from kvyard.router.cache_index import CacheIndex

# Where an engine's medium puts a block among kvyard's sources: its device cache, its own lower tiers (vLLM's CPU
# offloading and storage, SGLang's host memory and disk, kvyard's connector's memory and disk), or the shared store
# kvyard's connector writes to (which every replica loading from that store can take a block from).
_DEVICE_MEDIA = frozenset({"GPU", "DEVICE", "HBM"})
SHARED_MEDIUM = "KVYARD_SHARED"


def medium_source(medium: str | None) -> str:
    if medium is None:
        return "device"
    medium = medium.upper()
    return "device" if medium in _DEVICE_MEDIA else "shared" if medium == SHARED_MEDIUM else "local"


@dataclass(slots=True)
class EngineBlockKeys:
    index: CacheIndex
    namespace: KeyNamespace
    _keys: dict[EngineHash, bytes] = field(default_factory=dict)
    _roots: dict[tuple[str | None, str | None], bytes] = field(default_factory=dict)
    unkeyed_blocks: int = 0  # stored blocks that could not be keyed, since the router started
    ignored_group_blocks: int = 0  # blocks of KV-cache groups past the first (hybrid models)
    # When the index last learned it does not know everything the engine holds (a block whose parent it never saw,
    # or a history it could not replay whole): `engine_sync` then asks the engine to announce reused blocks.
    missed_at: float = -math.inf
    # Blocks the replica put into (kind "stored") or saw leave ("removed") the shared store it loads from: the
    # router files them under that store (tier_index), not under the replica.
    on_shared: Callable[[str, list[bytes]], None] | None = None

    def apply(self, seq: int, event: EngineEvent) -> None:
        if isinstance(event, StoredBlocks):
            self._stored(seq, event)
        elif isinstance(event, RemovedBlocks):
            self._removed(seq, event)
        elif isinstance(event, AllCleared):
            self.reset(seq)

    def reset(self, seq: int) -> None:
        """Nothing is held (a start, a reset, a restart, or events lost): the index is empty and follows events."""
        self.index.reset((), seq)
        self._keys.clear()

    def adopt_block_size(self, block_size: int, seq: int) -> bool:
        """The engine's events use `block_size`: key by it (an index of another size is dropped). True if changed."""
        if block_size == self.namespace.block_size:
            return False
        self.namespace = replace(self.namespace, block_size=block_size)
        self._roots.clear()
        self.reset(seq)
        return True

    def __len__(self) -> int:
        return len(self._keys)

    def _stored(self, seq: int, event: StoredBlocks) -> None:
        if event.group != 0:
            self.ignored_group_blocks += len(event.hashes)
            return
        if event.block_size != self.namespace.block_size:
            self.adopt_block_size(event.block_size, seq)
        parent = self._root(event.lora_name, event.cache_salt) if event.parent is None else self._keys.get(event.parent)
        keyable = event.keyable if parent is not None else 0
        self.unkeyed_blocks += len(event.hashes) - keyable
        if parent is None:
            self.missed_at = time.monotonic()
        if parent is None or not keyable:
            return
        # Blocks announced again (an engine reporting the blocks a request reused) keep the keys they have.
        known, keys = self._keys, list[bytes]()
        while len(keys) < keyable and (key := known.get(event.hashes[len(keys)])) is not None:
            keys.append(key)
        if len(keys) < keyable:
            size, done = event.block_size, len(keys)
            encoded = encode_tokens(event.token_ids[done * size : keyable * size])
            new = chain_encoded_keys(keys[-1] if keys else parent, encoded, size, keyable - done)
            known.update(zip(event.hashes[done:keyable], new))
            keys += new
        source = medium_source(event.medium)
        if source != "shared":
            self.index.apply(seq, "stored", keys, source)
        elif self.on_shared is not None:
            self.on_shared("stored", keys)

    def _removed(self, seq: int, event: RemovedBlocks) -> None:
        if event.group != 0:
            return
        keys = [key for engine_hash in event.hashes if (key := self._keys.get(engine_hash)) is not None]
        source = medium_source(event.medium)
        if source == "shared":
            if self.on_shared is not None:
                self.on_shared("removed", keys)
            return
        self.index.apply(seq, "removed", keys, source)
        exact, local = self.index.exact, self.index.local
        for engine_hash in event.hashes:
            key = self._keys.get(engine_hash)
            if key is not None and key not in local and (exact is None or key not in exact):
                del self._keys[engine_hash]  # held in no medium any more: the map holds what the engine holds

    def _root(self, lora_name: str | None, cache_salt: str | None) -> bytes:
        root = self._roots.get((lora_name, cache_salt))
        if root is None:
            namespace = self.namespace if lora_name is None else replace(self.namespace, model_name=lora_name)
            root = self._roots[(lora_name, cache_salt)] = namespace.with_salt(cache_salt).root_key()
        return root

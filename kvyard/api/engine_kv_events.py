"""The KV events that vLLM and SGLang publish over ZMQ, decoded into one shape the router can index.

A publisher's PUB socket sends three frames per message: a topic, the message's sequence number (8 bytes,
big-endian, from 0 when the publisher starts) and a msgpack `KVEventBatch`: `[timestamp, events, rank]`.
vLLM (0.11 and later) encodes each event as a map tagged by its `type`; older vLLM and SGLang encode it as an
array whose first item is the tag and whose other items are the fields in declaration order. Three kinds:

- `BlockStored`: `block_hashes`, `parent_block_hash` (None for a prefix's first block), `token_ids` (every
  stored block's tokens, concatenated), `block_size`, `lora_id`, `medium`, then in newer vLLM `lora_name`,
  `extra_keys` (one entry per block: the LoRA name, `(mm_identifier, offset)` pairs, the cache salt on a
  prefix's first block, prompt-embedding digests) and `group_idx` (the KV-cache group; hybrid models have more
  than one);
- `BlockRemoved`: `block_hashes`, `medium`;
- `AllBlocksCleared`.

The replay socket (ROUTER) answers an 8-byte start sequence number with one `(topic, seq, payload)` message per
batch it still holds from there on, then `seq = -1`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

EngineHash = int | bytes  # a block hash as the engine publishes it (vLLM: 64-bit int by default, or bytes)
END_OF_REPLAY = -1
SEQ_BYTES = 8

# Field order of the array encoding (older vLLM, SGLang); the map encoding names its fields.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class EventFormatError(ValueError):
    """A message that is not a KV-event batch (or not one this reader understands)."""


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """Blocks an engine cached, in prefix order: block i holds `token_ids[i * block_size:(i + 1) * block_size]`
    and chains from block i - 1 (the first one from `parent`, or from the prefix's root when `parent` is None)."""

    hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None
    group: int
    lora_name: str | None
    cache_salt: str | None  # of the prefix's first block (the salt seeds its root)
    # How many leading blocks the router can key from tokens alone: a block whose hash also covers an image or
    # prompt embeddings, and every block after it, cannot be.
    keyable: int


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    hashes: tuple[EngineHash, ...]
    medium: str | None
    group: int


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped its whole prefix cache (a reset)."""


EngineEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    timestamp: float
    events: list[EngineEvent]
    rank: int | None  # the data-parallel rank that published it


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    """Where a replica publishes: its PUB socket, and its replay (ROUTER) socket if it has one."""

    publisher: str
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> EventEndpoints:
        """`tcp://HOST:PORT` or `tcp://HOST:PORT,tcp://HOST:REPLAY_PORT`."""
        parts = [part.strip() for part in text.split(",")]
        if not 1 <= len(parts) <= 2 or not all(part.startswith(("tcp://", "ipc://")) and part[6:] for part in parts):
            raise ValueError(f"KV events endpoint must be tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], got {text!r}")
        return cls(parts[0], parts[1] if len(parts) == 2 else None)

    def __str__(self) -> str:
        return self.publisher if self.replay is None else f"{self.publisher},{self.replay}"


@dataclass(slots=True)
class EventBatchDecoder:
    """Decodes `(topic, seq, payload)` frames; one per subscription (msgspec's decoder is reused)."""

    _decoder: msgspec.msgpack.Decoder[Any] = field(default_factory=msgspec.msgpack.Decoder)

    def decode(self, frames: Sequence[bytes]) -> EventBatch:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            raise EventFormatError(f"expected (topic, 8-byte seq, payload) frames, got {len(frames)} frame(s)")
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = self._decoder.decode(frames[2])
        except msgspec.DecodeError as error:
            raise EventFormatError(f"batch {seq} is not msgpack: {error}") from None
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise EventFormatError(f"batch {seq} is not [timestamp, events, rank]")
        rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
        events = [event for raw in batch[1] if (event := _event(raw)) is not None]
        return EventBatch(seq, float(batch[0]), events, rank)


def _event(raw: Any) -> EngineEvent | None:
    """One event, or None for a kind this reader does not know (a newer engine's)."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventFormatError(f"an event is neither a tagged map nor a tagged array: {raw!r:.80}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return RemovedBlocks(_hashes(fields), _medium(fields), _group(fields))
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None


def _stored(fields: dict[str, Any]) -> StoredBlocks:
    hashes = _hashes(fields)
    token_ids, block_size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(token_ids, list) or not isinstance(block_size, int) or block_size <= 0:
        raise EventFormatError("BlockStored without token_ids or a block_size")
    parent = fields.get("parent_block_hash")
    if parent is not None and not isinstance(parent, (int, bytes)):
        raise EventFormatError(f"BlockStored parent_block_hash is neither an integer nor bytes: {parent!r:.40}")
    lora_name = fields.get("lora_name") if isinstance(fields.get("lora_name"), str) else None
    salt, keyable = _read_extra_keys(fields.get("extra_keys"), len(hashes), lora_name, first=parent is None)
    if len(token_ids) != len(hashes) * block_size:
        keyable = 0  # a partial block (vLLM's hash granularity below the block size): not a chain of full blocks
    return StoredBlocks(
        hashes, parent, token_ids, block_size, _medium(fields), _group(fields), lora_name, salt, keyable
    )


def _read_extra_keys(extra: Any, count: int, lora_name: str | None, first: bool) -> tuple[str | None, int]:
    """(the cache salt, how many leading blocks depend on nothing but their tokens, the LoRA and that salt)."""
    if not isinstance(extra, list):
        return None, count
    salt = None
    for index, entry in enumerate(extra[:count]):
        if entry is None:
            continue
        items = list(entry) if isinstance(entry, list | tuple) else [entry]
        if lora_name is not None and items and items[0] == lora_name:
            items = items[1:]
        if first and index == 0 and len(items) == 1 and isinstance(items[0], str):
            salt = items[0]
        elif items:  # image positions or prompt-embedding digests: the router cannot recompute them
            return salt, index
    return salt, count


def _hashes(fields: dict[str, Any]) -> tuple[EngineHash, ...]:
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, (int, bytes)) for h in hashes):
        raise EventFormatError("block_hashes is not a list of integers or bytes")
    return tuple(hashes)


def _medium(fields: dict[str, Any]) -> str | None:
    medium = fields.get("medium")
    return medium if isinstance(medium, str) else None


def _group(fields: dict[str, Any]) -> int:
    group = fields.get("group_idx")
    return group if isinstance(group, int) else 0


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER socket sends to a publisher's replay socket to get every batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]

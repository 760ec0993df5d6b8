"""Block keys: the content address of one full block of KV (docs/contracts.md §1).

`key = SHA-256(parent_key || len || token_ids as little-endian uint32 || extra)[:16]`, chained
from a root derived from the namespace. Everything that changes the bytes of the KV (model
identity, dtype, block size, layout version) or must isolate tenants (cache salt) is in the
namespace, so equal keys mean interchangeable blocks in every process on every machine.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

KEY_BYTES = 16
KV_LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    model_name: str
    model_digest: str
    dtype: str
    block_size: int
    layout_version: int = KV_LAYOUT_VERSION
    cache_salt: str = ""

    def with_salt(self, cache_salt: str | None) -> KeyNamespace:
        return KeyNamespace(
            self.model_name,
            self.model_digest,
            self.dtype,
            self.block_size,
            self.layout_version,
            cache_salt or "",
        )

    def root_key(self) -> bytes:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvyard-namespace\x00" + canonical).digest()[:KEY_BYTES]


_NATIVE_UINT32_LE = array.array("I").itemsize == 4 and sys.byteorder == "little"


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """The canonical byte encoding of token ids inside a block key: little-endian uint32."""
    if _NATIVE_UINT32_LE:
        if isinstance(token_ids, array.array) and token_ids.typecode == "I":
            return token_ids.tobytes()
        if isinstance(token_ids, list | tuple):
            return array.array("I", token_ids).tobytes()  # a few times faster than numpy on a list of ints
    return np.asarray(token_ids, dtype="<u4").tobytes()


def key_from_encoded(parent_key: bytes, encoded_tokens: bytes, extra: bytes = b"") -> bytes:
    """`block_key` of tokens already passed through `encode_tokens` (4 bytes per token)."""
    digest = hashlib.sha256(parent_key)
    digest.update((len(encoded_tokens) // 4).to_bytes(4, "little"))
    digest.update(encoded_tokens)
    digest.update(extra)
    return digest.digest()[:KEY_BYTES]


def block_key(parent_key: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    return key_from_encoded(parent_key, encode_tokens(token_ids), extra)


def chain_block_keys(parent_key: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of every full block of `token_ids`, chained from `parent_key` (a root or a block key).

    Equal to chaining `block_key` block by block; the tokens are encoded once for all blocks.
    """
    num_full = len(token_ids) // block_size
    return chain_encoded_keys(parent_key, encode_tokens(token_ids[: num_full * block_size]), block_size, num_full)


def chain_encoded_keys(parent_key: bytes, encoded: bytes, block_size: int, count: int, first: int = 0) -> list[bytes]:
    """Keys of blocks `first` to `first + count - 1` of tokens already encoded, chained from `parent_key` (the
    key of block `first - 1`, or the root). The same bytes as `key_from_encoded` block by block, hashed in one
    call a block: a router computes tens of thousands of keys for a long prompt."""
    stride = 4 * block_size
    header = block_size.to_bytes(4, "little")
    sha256 = hashlib.sha256
    keys: list[bytes] = []
    for start in range(first * stride, (first + count) * stride, stride):
        parent_key = sha256(parent_key + header + encoded[start : start + stride]).digest()[:KEY_BYTES]
        keys.append(parent_key)
    return keys

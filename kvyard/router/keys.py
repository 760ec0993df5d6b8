"""Block keys of a prompt, computed the way every replica computes them (DESIGN.md, contract 1).

Byte-identical to `kvyard.kvcache.block_key.chain_block_keys`, but converts the token ids once and hashes
slices of that buffer, which makes the per-request cost of routing a long prompt several times smaller.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvyard.kvcache.block_key import KEY_BYTES, KeyNamespace


@dataclass(slots=True)
class PromptKeys:
    """Lazily computed chained block keys of one prompt under one namespace."""

    root: bytes
    block_size: int
    token_bytes: bytes
    num_blocks: int
    _keys: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, root: bytes, block_size: int, token_ids: Sequence[int]) -> PromptKeys:
        data = array("I", token_ids)
        if data.itemsize != 4:
            data = array("L", token_ids)
        if array("I", [1]).tobytes()[0] != 1:
            data.byteswap()
        return cls(root, block_size, data.tobytes(), len(token_ids) // block_size)

    def key(self, index: int) -> bytes:
        """Key of block `index` (computing every key before it first)."""
        keys, width = self._keys, self.block_size * 4
        length = self.block_size.to_bytes(4, "little")
        while len(keys) <= index:
            parent = keys[-1] if keys else self.root
            start = len(keys) * width
            keys.append(hashlib.sha256(parent + length + self.token_bytes[start : start + width]).digest()[:KEY_BYTES])
        return keys[index]

    def all(self) -> list[bytes]:
        if self.num_blocks:
            self.key(self.num_blocks - 1)
        return self._keys

    def __iter__(self) -> Iterator[bytes]:
        for index in range(self.num_blocks):
            yield self.key(index)


def namespace_root(namespace: KeyNamespace, cache_salt: str | None) -> bytes:
    return namespace.with_salt(cache_salt).root_key()

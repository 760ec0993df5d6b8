"""Block keys of a prompt, computed the way every replica computes them (docs/contracts.md §1).

The same keys as `kvyard.kvcache.block_key.chain_block_keys` (built from its `encode_tokens` and
`chain_encoded_keys`), computed lazily: routing often needs only the keys up to the first miss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvyard.kvcache.block_key import KeyNamespace, chain_encoded_keys, encode_tokens

AHEAD = 8  # keys computed past the one asked for


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
        return cls(root, block_size, encode_tokens(token_ids), len(token_ids) // block_size)

    def key(self, index: int) -> bytes:
        """Key of block `index` (computing every key before it first, and a few after it: a lookup that needs
        this one mostly needs the next ones too)."""
        keys = self._keys
        if len(keys) <= index:
            count = min(max(index + 1 - len(keys), AHEAD), self.num_blocks - len(keys))
            parent = keys[-1] if keys else self.root
            keys += chain_encoded_keys(parent, self.token_bytes, self.block_size, count, len(keys))
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

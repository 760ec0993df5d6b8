"""Segment fingerprints: a full block named by its own tokens, wherever in a prompt they sit (docs/contracts.md §3).

A block key (block_key.py) names a block by everything before it. A segment fingerprint names it by its
`block_size` tokens and the namespace root (model, dtype, block size, tenant), so that text which moved to other
positions is still found: a prompt is searched at every offset. The fingerprint is a polynomial hash of the tokens,
so the windows at every offset of a prompt are hashed at once (numpy), combined with the first 8 bytes of the root.
It is a screen, not a proof: a replica compares tokens before it reuses a block; a router only scores with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MULTIPLIER = 0x100000001B3  # FNV's 64-bit prime: odd, so no token's bits are shifted out
MASK = (1 << 64) - 1


def window_hash(tokens: Sequence[int]) -> int:
    """The polynomial hash of one window (what `window_hashes` gives for it), without numpy's call overhead."""
    value = 0
    for token in tokens:
        value = (value * MULTIPLIER + token + 1) & MASK
    return value


def window_hashes(tokens: Sequence[int], size: int) -> np.ndarray:
    """uint64 [len(tokens) - size + 1]: `window_hash` of every window of `size` tokens (wrapping arithmetic)."""
    values = np.asarray(tokens, dtype=np.uint64)
    count = len(values) - size + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    multiplier = np.uint64(MULTIPLIER)
    with np.errstate(over="ignore"):
        for offset in range(size):
            hashes = hashes * multiplier + values[offset : offset + count] + np.uint64(1)
    return hashes


def root_mix(root: bytes) -> int:
    return int.from_bytes(root[:8], "little")


def segment_fingerprint(tokens: Sequence[int], root: bytes) -> int:
    """The fingerprint of one full block's tokens under the namespace root `root`."""
    return window_hash(tokens) ^ root_mix(root)


def prompt_fingerprints(tokens: Sequence[int], root: bytes, block_size: int) -> np.ndarray:
    """uint64: the fingerprint of the window starting at every position of a prompt."""
    return window_hashes(tokens, block_size) ^ np.uint64(root_mix(root))

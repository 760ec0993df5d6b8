"""Copy whole blocks of the paged KV cache out to host memory and back.

Each layer's cache is `[2, num_slots, num_kv_heads, head_dim]` with slot = block_id * block_size +
offset. A block's KV across all layers is `[num_layers, 2, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_shape(kv_caches: Sequence[torch.Tensor], block_size: int) -> tuple[int, ...]:
    _, _, num_kv_heads, head_dim = kv_caches[0].shape
    return (len(kv_caches), 2, block_size, num_kv_heads, head_dim)


def read_blocks(kv_caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int]) -> torch.Tensor:
    """A host copy of the blocks' KV: `[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]`."""
    first = kv_caches[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    out = torch.empty((len(block_ids), *block_shape(kv_caches, block_size)), dtype=first.dtype)
    for layer, cache in enumerate(kv_caches):
        paged = cache.view(2, -1, block_size, *cache.shape[2:])
        out[:, layer] = paged.index_select(1, index).transpose(0, 1)
    return out


def write_blocks(
    kv_caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int], blocks: torch.Tensor
) -> None:
    """Inverse of `read_blocks`: put `blocks` into the cache at `block_ids` (one copy per layer)."""
    first = kv_caches[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    data = blocks.to(device=first.device, dtype=first.dtype)
    for layer, cache in enumerate(kv_caches):
        paged = cache.view(2, -1, block_size, *cache.shape[2:])  # [2, num_blocks, block_size, Hkv, D]
        paged.index_copy_(1, index, data[:, layer].transpose(0, 1))

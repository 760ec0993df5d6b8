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


def _slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)
    return (blocks[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)


def read_blocks(kv_caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int]) -> torch.Tensor:
    """A host copy of the blocks' KV: `[len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]`."""
    slots = _slots(block_ids, block_size, kv_caches[0].device)
    stacked = torch.stack([cache.index_select(1, slots) for cache in kv_caches])
    num_layers, _, _, num_kv_heads, head_dim = stacked.shape
    per_block = stacked.view(num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim)
    return per_block.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def write_blocks(
    kv_caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int], blocks: torch.Tensor
) -> None:
    """Inverse of `read_blocks`: put `blocks` into the cache at `block_ids`."""
    first = kv_caches[0]
    slots = _slots(block_ids, block_size, first.device)
    data = blocks.to(device=first.device, dtype=first.dtype)
    num_kv_heads, head_dim = first.shape[2], first.shape[3]
    for layer, cache in enumerate(kv_caches):
        layer_kv = data[:, layer].permute(1, 0, 2, 3, 4).reshape(2, len(block_ids) * block_size, num_kv_heads, head_dim)
        cache.index_copy_(1, slots, layer_kv)

"""Copy whole blocks of the paged KV cache out to host memory and back.

Each layer's cache is `[2, num_slots, num_kv_heads, row]` with slot = block_id * block_size + offset (a row in
the cache's format, `kvyard.models.kv_format`). A block's KV across all layers is
`[num_layers, 2, block_size, num_kv_heads, row]`, copied as the bytes it is stored in.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvyard.kvcache.codec import BlockFormat, DecodedBlock


def block_shape(kv_caches: Sequence[torch.Tensor], block_size: int) -> tuple[int, ...]:
    planes, _, num_kv_heads, head_dim = kv_caches[0].shape  # keys and values, or latent attention's one row
    return (len(kv_caches), planes, block_size, num_kv_heads, head_dim)


def read_blocks(kv_caches: Sequence[torch.Tensor], block_size: int, block_ids: Sequence[int]) -> torch.Tensor:
    """A host copy of the blocks' KV: `[len(block_ids), num_layers, planes, block_size, num_kv_heads, head_dim]`."""
    first = kv_caches[0]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    out = torch.empty((len(block_ids), *block_shape(kv_caches, block_size)), dtype=first.dtype)
    for layer, cache in enumerate(kv_caches):
        paged = cache.view(cache.shape[0], -1, block_size, *cache.shape[2:])
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
        paged = cache.view(cache.shape[0], -1, block_size, *cache.shape[2:])  # [planes, blocks, block_size, Hkv, D]
        paged.index_copy_(1, index, data[:, layer].transpose(0, 1))


class DeviceBlocks:
    """Whole blocks of the paged KV cache as bytes in the block codec's format: what the KV tier stores and
    what replicas send each other."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size: int, format_name: str) -> None:
        """`format_name`: the KV format as the block codec names it (`KVFormat.codec_name`)."""
        self.kv_caches = kv_caches
        self.block_size = block_size
        self._dtype = kv_caches[0].dtype
        self.format = BlockFormat(format_name, block_shape(kv_caches, block_size))

    def read(self, block_ids: Sequence[int]) -> list[memoryview]:
        """A host copy of each block's bytes, taken now (the blocks may be reused right after)."""
        if not block_ids:
            return []
        raw = read_blocks(self.kv_caches, self.block_size, block_ids).view(torch.uint8).reshape(len(block_ids), -1)
        return [memoryview(row) for row in raw.numpy()]

    def write(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None:
        """Copy verified blocks into the device cache at `block_ids`."""
        if not blocks:
            return
        staging = np.empty((len(blocks), blocks[0].payload.nbytes), dtype=np.uint8)
        for row, block in zip(staging, blocks):
            row[:] = np.frombuffer(block.payload, dtype=np.uint8)
        data = torch.from_numpy(staging).view(self._dtype).view(len(blocks), *self.format.shape)
        write_blocks(self.kv_caches, self.block_size, block_ids, data)

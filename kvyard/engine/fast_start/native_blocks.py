"""Whole blocks of the fast-start engine's KV cache (numpy arrays) as bytes in the block codec's format, as
kvyard.engine.kv_links.device_blocks.DeviceBlocks reads and writes PyTorch's: the KV tier and block transfers work
before PyTorch has loaded, and a block read by either is the same bytes.

Each layer's cache is `[2, num_slots, num_kv_heads, row]`; a block across all layers is
`[num_layers, 2, block_size, num_kv_heads, row]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvyard.kvcache.codec import BlockFormat, DecodedBlock

# The block codec's name of each KV format (kvyard.models.kv_format.KVFormat.codec_name).
CODEC_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8-rowscale"}


class NumpyBlocks:
    def __init__(self, kv_caches: Sequence[np.ndarray], block_size: int, kv_name: str) -> None:
        self.block_size = block_size
        _, _, num_kv_heads, row = kv_caches[0].shape
        # [2, num_blocks, block_size, Hkv, row] views: a block is one index on axis 1
        self.paged = [cache.reshape(2, -1, block_size, num_kv_heads, row) for cache in kv_caches]
        self.format = BlockFormat(CODEC_NAMES[kv_name], (len(kv_caches), 2, block_size, num_kv_heads, row))

    def read(self, block_ids: Sequence[int]) -> list[memoryview]:
        """A copy of each block's bytes, taken now (the blocks may be reused right after)."""
        if not block_ids:
            return []
        index = np.asarray(block_ids, dtype=np.int64)
        out = np.empty((len(block_ids), *self.format.shape), dtype=self.paged[0].dtype)
        for layer, paged in enumerate(self.paged):
            out[:, layer] = paged[:, index].swapaxes(0, 1)
        raw = out.view(np.uint8).reshape(len(block_ids), -1)
        return [row.data for row in raw]

    def write(self, block_ids: Sequence[int], blocks: Sequence[DecodedBlock]) -> None:
        """Copy verified blocks into the cache at `block_ids`."""
        if not blocks:
            return
        index = np.asarray(block_ids, dtype=np.int64)
        dtype = self.paged[0].dtype
        data = np.stack([np.frombuffer(block.payload, dtype=dtype).reshape(self.format.shape) for block in blocks])
        for layer, paged in enumerate(self.paged):
            paged[:, index] = data[:, layer].swapaxes(0, 1)

"""vLLM's paged KV cache seen as kvyard blocks: block `b` of every attention layer, stacked, is one block's payload.

vLLM hands the connector one tensor per layer with the block index at dimension 0 (its standardized layouts; CPU:
`[num_blocks, kv_heads, block_size, 2 * head_size]`) or, in older GPU layouts, at dimension 1 behind K/V. A step's
blocks to save are copied into one host buffer of frames (each block's payload behind room for its header, which the
tier's writer fills in place): on a CPU one copy per layer straight out of the cache, on a GPU a gather on the device
and one transfer. A request's loaded blocks go back in one transfer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvyard.kvcache.codec import HEADER_BYTES, BlockFormat


class PagedBlocks:
    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("the kvyard connector found no KV cache layers")
        self.layer_names = sorted(kv_caches)
        self.layers = [kv_caches[name] for name in self.layer_names]
        first = self.layers[0]
        if any(layer.shape != first.shape or layer.dtype != first.dtype for layer in self.layers):
            shapes = sorted({(tuple(layer.shape), str(layer.dtype)) for layer in self.layers})
            raise ValueError(f"the kvyard connector needs every layer's KV cache alike, got {shapes}")
        if first.shape[0] == num_blocks:
            self.block_dim = 0
        elif first.dim() > 1 and first.shape[1] == num_blocks:
            self.block_dim = 1
        else:
            raise ValueError(f"no dimension of the KV cache {tuple(first.shape)} counts its {num_blocks} blocks")
        self.device = first.device
        self.dtype = first.dtype
        block_shape = tuple(first.shape[: self.block_dim]) + tuple(first.shape[self.block_dim + 1 :])
        self.format = BlockFormat(str(self.dtype).removeprefix("torch."), (len(self.layers), *block_shape))
        self.block_bytes = first.element_size() * self.format.num_elements
        # On a CPU each layer's blocks are copied straight into the frames; elsewhere one gather and one transfer.
        self.gather_on_device = self.device.type != "cpu"

    def read(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Each block's payload in a frame, copied out of the cache now (the cache may reuse the block at once)."""
        if not block_ids:
            return []
        frames = torch.empty((len(block_ids), HEADER_BYTES + self.block_bytes), dtype=torch.uint8)
        payloads = frames[:, HEADER_BYTES:].view(self.dtype).view(len(block_ids), *self.format.shape)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if self.gather_on_device:
            gathered = [layer.index_select(self.block_dim, index).movedim(self.block_dim, 0) for layer in self.layers]
            payloads.copy_(torch.stack(gathered, dim=1))
        else:
            for number, layer in enumerate(self.layers):
                torch.index_select(layer, self.block_dim, index, out=payloads[:, number].movedim(0, self.block_dim))
        return [memoryview(frame) for frame in frames.numpy()]

    def write(self, block_ids: Sequence[int], payloads: Sequence[memoryview | bytes]) -> None:
        """Put each payload into its block of every layer."""
        if not block_ids:
            return
        joined = bytearray(b"".join(payloads))
        if len(joined) != self.block_bytes * len(block_ids):
            raise ValueError(f"{len(joined)} bytes for {len(block_ids)} blocks of {self.block_bytes}")
        shape = (len(block_ids), *self.format.shape)
        data = torch.frombuffer(joined, dtype=torch.uint8).view(self.dtype).reshape(shape).to(self.device)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for number, layer in enumerate(self.layers):
            layer.index_copy_(self.block_dim, index, data[:, number].movedim(0, self.block_dim))

"""The decoder layers of a step of few rows, one native call each (`kvyard_decode_layer`).

A decode step of one or a few sequences on CPU spends as long calling its kernels from Python (a dozen per
layer: norms, projections, rotary, the KV store, attention, the MLP) as in the kernels themselves. For a step
with few enough rows that every projection takes its native small-rows kernel (a decode step of a small batch,
a speculative verification, a short prefill chunk), the whole layer runs in C instead: the same kernels in the
same order, so the hidden states are bit-identical to the modules' (tests/test_fused_decode.py holds that for
every architecture, weight format and KV format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kvyard.kernels.ops import WEIGHT_KINDS, DecodeLayerKernel, DecodeLayerWeights, DecodeStepArgs
from kvyard.models.attention import AttentionMetadata
from kvyard.models.layers import GatedMLP, Linear
from kvyard.models.quantization import HalfLinear, Int8Linear

if TYPE_CHECKING:
    from kvyard.models.decoder import Attention, CausalLM, DecoderLayer


@dataclass(slots=True)
class FusedDecode:
    """The fixed arguments of every layer's call, made once when the model takes its fast paths."""

    kernel: DecodeLayerKernel
    shape: tuple[int, int, int, int, int]  # hidden, intermediate, heads, KV heads, head dim
    layer_args: list[tuple[Any, ...]]
    max_rows: int  # beyond this, a projection would leave its small-rows kernel (and the modules' arithmetic)
    _checked_caches: list[torch.Tensor] | None = None

    @classmethod
    def build(cls, model: CausalLM, kernel: DecodeLayerKernel) -> FusedDecode | None:
        """None when a layer has something the fused call does not compute (a projection without its native
        kernel, a bias other than the QKV projection's, fused elementwise work switched off)."""
        config = model.config
        if config.moe is not None or config.latent is not None:  # the fused call: dense MLPs, GQA attention only
            return None
        shape = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads, config.head_dim)
        decoder_layers = [cast("DecoderLayer", layer) for layer in model.model.layers]
        layers = [_layer_args(layer, kernel, shape, model) for layer in decoder_layers]
        if not layers or any(args is None for args in layers):
            return None
        max_rows = min(_max_rows(linear) for layer in decoder_layers for linear in _linears(layer))
        return cls(kernel, shape, [args for args in layers if args is not None], max_rows)

    def applies(self, meta: AttentionMetadata, hidden: torch.Tensor) -> bool:
        rows = hidden.shape[0]
        return 0 < rows <= self.max_rows and meta.backend.name == "native" and hidden.dtype == torch.float32

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream): what the layers' modules return."""
        if self._checked_caches is not kv_caches:
            for cache in kv_caches:
                DecodeStepArgs.check_cache(cache, self.shape[4])
            self._checked_caches = kv_caches
        rows = hidden.shape[0]
        tables = meta.decode_block_tables
        scratch = self.kernel.scratch(rows, self.shape, tables.shape[1] * meta.block_size)
        chunks, chunk_tables = _chunks(meta)
        step = DecodeStepArgs.of(
            positions,
            meta.slot_mapping,
            tables,
            meta.decode_context_lens,
            chunks,
            chunk_tables,
            meta.block_size,
            kv_caches[0],
            scratch,
        )
        residual = hidden.contiguous()  # the embeddings become the residual stream, updated in place
        out = torch.empty_like(residual)
        x: torch.Tensor | None = None
        for args, cache in zip(self.layer_args, kv_caches, strict=True):
            self.kernel(x, residual, out, step, cache, args)
            x = out
        return out, residual


def _chunks(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's prefill chunks as the kernel reads them: [num_chunks, 4] (first row, rows, context length, offset
    of the chunk's block table in the second tensor or -1 for a chunk that is its whole context), and the tables."""
    rows: list[list[int]] = []
    tables: list[torch.Tensor] = []
    offset = 0
    for span in meta.prefills:
        table = -1
        if span.block_table is not None:
            table = offset
            tables.append(span.block_table)
            offset += span.block_table.shape[0]
        rows.append([span.query_start, span.query_len, span.context_len, table])
    chunk_tables = torch.cat(tables) if tables else torch.zeros(0, dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long).view(len(rows), 4), chunk_tables


def _layer_args(
    layer: DecoderLayer, kernel: DecodeLayerKernel, shape: tuple[int, int, int, int, int], model: CausalLM
) -> tuple[Any, ...] | None:
    attn, mlp = cast("Attention", layer.self_attn), cast("GatedMLP", layer.mlp)  # GQA, dense layers only (build)
    natives = (layer.input_layernorm, layer.post_attention_layernorm, mlp, attn.rotary)
    if any(module.native is None for module in natives):
        return None
    qk_norms = None
    if attn.q_norm is not None and attn.k_norm is not None:
        if attn.q_norm.native is None or attn.k_norm.native is None:
            return None
        qk_norms = (attn.q_norm.weight.data, attn.k_norm.weight.data)
    linears = [_weights(linear) for linear in _linears(layer)]
    if any(weights is None for weights in linears):
        return None
    qkv, o, gate_up, down = (weights for weights in linears if weights is not None)
    if o.bias is not None or gate_up.bias is not None or down.bias is not None:
        return None
    norms = (layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data)
    rotary = (model.rotary.cos_table, model.rotary.sin_table)
    return kernel.layer_args(
        shape, layer.input_layernorm.eps, norms, qk_norms, (qkv, o, gate_up, down), rotary, attn.scale
    )


def _linears(layer: DecoderLayer) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    attn, mlp = cast("Attention", layer.self_attn), cast("GatedMLP", layer.mlp)  # GQA, dense layers only (build)
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _weights(linear: nn.Module) -> DecodeLayerWeights | None:
    """The weights a projection computes with on its native small-rows path; None if it has none."""
    bias = linear.bias.data if isinstance(linear.bias, torch.Tensor) else None
    if isinstance(linear, Int8Linear) and linear.kernel is not None:
        return DecodeLayerWeights(WEIGHT_KINDS[torch.int8], linear.qweight, linear.scales, bias)
    if isinstance(linear, HalfLinear) and linear.kernel is not None:
        return DecodeLayerWeights(WEIGHT_KINDS[linear.weight16.dtype], linear.weight16, None, bias)
    if isinstance(linear, Linear) and linear.small_kernel is not None and linear.weight.dtype == torch.float32:
        return DecodeLayerWeights(WEIGHT_KINDS[torch.float32], linear.weight.data, None, bias)
    return None


def _max_rows(linear: nn.Module) -> int:
    return int(getattr(linear, "max_small_rows", 0))

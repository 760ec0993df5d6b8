"""The decoder layers of a many-row step in bf16 activations, for a model that multiplies in bf16.

With `--matmul-dtype bfloat16`, each projection rounds its input to bf16 and returns an fp32 copy of its bf16
product, so a layer of a prefill step converts its activations between fp32 and bf16 eight times (an eighth of a
2,048-token prefill's operator time on the bench preset, and PyTorch's bf16 SiLU and product another tenth).
Here the activations stay in bf16 from the norm to the attention and from the attention to the next norm: the
norms read the residual stream in fp32 and write bf16, rotary rotates bf16 queries, and SiLU-and-multiply runs on
bf16. Each value is rounded where the modules round it, so the hidden states are bit-identical to theirs
(tests/test_bf16_prefill.py). The keys, the values and any decode rows' queries take their fp32 route as in the
modules: the cache stores what it stores from fp32 keys, in any KV format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from kvyard.kernels.ops import ElementwiseKernels
from kvyard.models.attention import AttentionMetadata
from kvyard.models.attention_backends import CPUNativeBackend, bf16_prefill_attention
from kvyard.models.layers import GatedMLP, Linear, RotaryEmbedding, bf16_product
from kvyard.models.quantization import HalfLinear, Int8Linear

if TYPE_CHECKING:
    from kvyard.models.decoder import Attention, CausalLM, DecoderLayer

Projection = Linear | Int8Linear | HalfLinear
_MANY_ROWS = 1 << 20  # a step this long multiplies in bf16 wherever the model does


@dataclass(slots=True)
class Bf16Prefill:
    """The model's layers, run with bf16 activations for a step of more rows than the small-rows kernels take."""

    kernels: ElementwiseKernels
    rotary: RotaryEmbedding
    layers: list[DecoderLayer]

    @classmethod
    def build(cls, model: CausalLM, kernels: ElementwiseKernels) -> Bf16Prefill | None:
        """None unless every layer is dense GQA attention without biases or query/key norms (Llama and Mistral
        shapes) and a gated MLP, with projections that multiply in bf16."""
        config = model.config
        if config.moe is not None or config.latent is not None or config.qk_norm or config.attention_bias:
            return None
        layers = [cast("DecoderLayer", layer) for layer in model.model.layers]
        if not layers or not all(isinstance(layer.mlp, GatedMLP) for layer in layers):
            return None
        if any(p.bf16_weight_for(_MANY_ROWS) is None for layer in layers for p in _projections(layer)):
            return None
        return cls(kernels, model.rotary, layers)

    def applies(self, meta: AttentionMetadata, hidden: torch.Tensor) -> bool:
        backend = meta.backend
        if not (meta.prefills and isinstance(backend, CPUNativeBackend) and backend.bf16_prefill):
            return False
        rows = hidden.shape[0]
        return hidden.dtype == torch.float32 and all(
            projection.bf16_weight_for(rows) is not None for layer in self.layers for projection in _projections(layer)
        )

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream): what the layers' modules return."""
        residual = hidden.clone()  # the embeddings become the residual stream, updated in place
        out: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            out = self._layer(layer, positions, out, residual, kv_cache, meta)
        assert out is not None
        return out.float(), residual

    def _layer(
        self,
        layer: DecoderLayer,
        positions: torch.Tensor,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv, o, gate_up, down = _projections(layer)
        norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        normed = self.kernels.add_rms_norm_bf16(x, residual, norm.weight, norm.eps)
        attention = self._attention(
            cast("Attention", layer.self_attn), positions, _product(qkv, normed), kv_cache, meta
        )
        normed = self.kernels.add_rms_norm_bf16(_product(o, attention), residual, post_norm.weight, post_norm.eps)
        return _product(down, self.kernels.silu_mul_bf16(_product(gate_up, normed)))

    def _attention(
        self,
        attn: Attention,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[T, Hq * D] bf16 attention output of a step's bf16 projections (a view of qkv's rows each)."""
        rows, decodes = qkv.shape[0], meta.num_decode_tokens
        q_end, k_end = attn.q_size, attn.q_size + attn.kv_size
        q = qkv[:, :q_end].view(rows, attn.num_heads, attn.head_dim)
        kernels, cos, sin = self.kernels, self.rotary.cos_table, self.rotary.sin_table
        # Keys, values and decode queries in fp32, as the modules compute them (the cache stores fp32 keys).
        k = qkv[:, q_end:k_end].view(rows, attn.num_kv_heads, attn.head_dim).float()
        v = qkv[:, k_end:].view(rows, attn.num_kv_heads, attn.head_dim)
        decode_q = q[:decodes].float()
        kernels.rotary(k, cos, sin, positions)
        if decodes:
            kernels.rotary(decode_q, cos, sin, positions[:decodes])
        kernels.rotary_bf16(q[decodes:], cos, sin, positions[decodes:])
        backend = meta.backend
        backend.store(kv_cache, meta.slot_mapping, k, v.float())
        out = torch.empty(rows, attn.num_heads, attn.head_dim, dtype=torch.bfloat16)
        if decodes:
            out[:decodes] = backend.decode(decode_q, kv_cache, meta, attn.scale)
        for span in meta.prefills:
            chunk = slice(span.query_start, span.query_start + span.query_len)
            out[chunk] = bf16_prefill_attention(
                q[chunk], k[chunk], v[chunk], kv_cache, span, meta.block_size, attn.scale
            )
        return out.view(rows, attn.q_size)


def _projections(layer: DecoderLayer) -> tuple[Projection, Projection, Projection, Projection]:
    attn, mlp = cast("Attention", layer.self_attn), cast(GatedMLP, layer.mlp)
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _product(projection: Projection, x: torch.Tensor) -> torch.Tensor:
    weight = projection.bf16_weight_for(x.shape[0])
    assert weight is not None  # applies() checked every projection for this many rows
    return bf16_product(x, weight, projection.bf16_onednn)

"""Decoder-only transformer covering the Llama, Qwen2 and Qwen3 families, dense or with expert layers (Mixtral,
Qwen2-MoE, Qwen3-MoE: kvyard.models.experts), and DeepSeek-V3 (latent attention: kvyard.models.latent_attention).

Parameter names follow the Hugging Face checkpoints, except that Q/K/V and gate/up projections
are fused (`qkv_proj`, `gate_up_proj`) so each layer runs three large matmuls instead of six;
`kvyard.models.loader` maps the checkpoint's separate tensors into the fused ones.
"""

from __future__ import annotations

import torch
from torch import nn

from kvyard.kernels.ops import NativeKernels
from kvyard.models.attention import AttentionMetadata, paged_attention
from kvyard.models.bf16_prefill import Bf16Prefill
from kvyard.models.config import ModelConfig
from kvyard.models.expert_residency import ExpertResidency
from kvyard.models.experts import SparseMoE
from kvyard.models.fused_decode import FusedDecode
from kvyard.models.latent_attention import LatentAttention
from kvyard.models.layers import (
    GatedMLP,
    Linear,
    NativeElementwise,
    RMSNorm,
    RotaryEmbedding,
    fits_in_half_of_memory,
    fits_in_memory,
)
from kvyard.models.quantization import HalfLinear, Int8Linear


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(positions, hidden)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))

    def project(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of normed hidden states, q and k rotated to `positions`: what the
        cache stores for these tokens (blending compares it with reused keys and values)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: Attention | LatentAttention
        if config.latent is not None:
            self.self_attn = LatentAttention(config.hidden_size, config.num_heads, config.latent, rotary)
        else:
            self.self_attn = Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: GatedMLP | SparseMoE
        if config.moe is not None and index in config.moe.sparse_layers:
            self.mlp = SparseMoE(config.hidden_size, config.moe)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it).

        Each residual add is fused with the norm that follows it; the next layer (or the final norm)
        adds the returned output."""
        if residual is None:
            normed, residual = self.input_layernorm.add_and_norm(None, hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.self_attn(positions, normed, kv_cache, meta)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # Given its (uninitialised) weight, the embedding skips drawing random values, which on the meta device
        # the loader builds on imports torch._dynamo: about 3 s of start-up. The checkpoint overwrites it anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Forward pass over a flat batch of tokens from many sequences, reading/writing paged KV."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.rotary_dim, max_positions)
        self.model = DecoderBody(config, self.rotary)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.fused_decode: FusedDecode | None = None  # set by use_cpu_fast_paths
        self.bf16_prefill: Bf16Prefill | None = None  # likewise
        self.expert_residency: ExpertResidency | None = None  # routed experts kept out of memory (paged_experts)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden_size]."""
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        fused, bf16 = self.fused_decode, self.bf16_prefill
        if fused is not None and fused.applies(meta, hidden):
            hidden, residual = fused(positions, hidden, kv_caches, meta)
        elif bf16 is not None and bf16.applies(meta, hidden):
            hidden, residual = bf16(positions, hidden, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return self.model.norm.add_and_norm(hidden, residual)[0] if residual is not None else self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def use_cpu_fast_paths(self, kernels: NativeKernels | None, bf16_matmul: bool = False) -> bool:
        """Put an fp32 CPU model on its fast paths; returns whether it is one (else this does nothing).

        Linears go through oneDNN, their weights packed into its layout when that copy fits in half of
        the memory available now; given `kernels`, few-row linears and the fused norm, rotary and SiLU
        work go through them too, and a decode step of few rows runs each layer in one native call (None:
        PyTorch ops only). The ModelRunner calls this once, after the
        weights are loaded (packing copies them, the fused decode path keeps their addresses: weights are not
        replaced afterwards) and before the first forward; a later call replaces what an earlier one chose.
        `bf16_matmul`: fp32, int8 and bf16 layers multiply many rows in bf16 (quantization.matmul_in_bf16; int8
        needs `kernels`): fp32 layers from a bf16 copy of their weights, int8 ones from one where it fits in memory."""
        params = list(self.parameters())
        if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
            return False
        # A paged expert's fp32 layers keep no packed copy: their weights come and go. (Its layers' bf16 copies
        # never arise: LLMEngine refuses bf16 matmuls with paged experts.)
        paged = self.expert_residency.holders() if self.expert_residency is not None else frozenset()
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        onednn = torch.backends.mkldnn.is_available()
        pack = onednn and fits_in_memory([m for m in linears if id(m) not in paged])
        for linear in linears:
            small = kernels.small_linear if kernels is not None else None
            linear.use_cpu_fast_paths(small, onednn, pack and id(linear) not in paged, bf16_matmul)
        int8_layers = [module for module in self.modules() if isinstance(module, Int8Linear)]
        # As packing fp32 weights: int8 weights keep a widened bf16 copy for bf16 matmuls where it fits.
        keep_bf16 = bf16_matmul and fits_in_half_of_memory(sum(2 * m.qweight.numel() for m in int8_layers))
        to_bf16 = kernels.int8_to_bf16 if kernels is not None and bf16_matmul else None
        for int8_layer in int8_layers:
            int8_layer.use_native_kernel(
                kernels.small_linear_int8 if kernels is not None else None, onednn, to_bf16, keep_bf16
            )
        half_layers = [module for module in self.modules() if isinstance(module, HalfLinear)]
        pack_half = fits_in_half_of_memory(sum(m.weight16.numel() * m.weight16.element_size() for m in half_layers))
        for half_layer in half_layers:
            in_bf16 = bf16_matmul and half_layer.weight16.dtype == torch.bfloat16
            small_kernel = kernels.small_linear_half if kernels is not None else None
            half_layer.use_native_kernel(small_kernel, onednn, in_bf16, pack_half)
        for module in self.modules():
            if isinstance(module, NativeElementwise):
                module.use_native_kernels(kernels.elementwise if kernels is not None else None)
        self.fused_decode = FusedDecode.build(self, kernels.decode_layer) if kernels is not None else None
        self.bf16_prefill = (
            Bf16Prefill.build(self, kernels.elementwise) if kernels is not None and bf16_matmul else None
        )
        return True

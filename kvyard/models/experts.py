"""The expert layer of a mixture-of-experts decoder (Mixtral, Qwen3-MoE): each token's MLP output is the weighted
sum of the outputs of the few experts its router scores highest.

Every expert is a gated MLP; their weights are stacked, gate and up fused as in the dense layers (`experts_gate_up`:
experts x 2*intermediate x hidden, `experts_down`: experts x hidden x intermediate), so the checkpoint's per-expert
tensors load into slices (kvyard.models.loader). Tokens are grouped by expert: each expert chosen by any token of
the step runs one matmul over exactly those tokens, and experts no token chose cost nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from kvyard.models.config import MoeConfig
from kvyard.models.layers import Linear


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.experts_per_token
        self.normalize = moe.normalize_top_k
        self.intermediate_size = moe.expert_intermediate_size
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * self.intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden_size, self.intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts): each token's chosen experts, highest score first, and the weights of their outputs."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        picks = experts.flatten()  # token t's k-th pick at t * top_k + k
        order = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=self.num_experts).tolist()
        pick_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            chosen = order[start : start + count]
            start += count
            tokens = chosen // self.top_k
            gate, up = (x[tokens] @ self.experts_gate_up[expert].T).split(self.intermediate_size, dim=-1)
            expert_out = (functional.silu(gate) * up) @ self.experts_down[expert].T
            out.index_add_(0, tokens, expert_out * pick_weights[chosen, None])
        return out

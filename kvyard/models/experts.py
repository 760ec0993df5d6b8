"""The expert layer of a mixture-of-experts decoder (Mixtral, Qwen2-MoE, Qwen3-MoE; DeepSeek-V3's routing): each
token's MLP output is the weighted sum of the outputs of the few experts its router scores highest (plus a shared
expert every token uses: Qwen2-MoE's gated, DeepSeek-V3's not).

Every expert is a dense layer's gated MLP (gate and up fused), so the checkpoint's per-expert tensors load as a
dense layer's do, and what converts or speeds up linear layers applies to experts too: int8, fp16 and bf16 weights
and packages, the native kernels for few rows, oneDNN for many. Tokens are grouped by expert: each expert chosen by
any token of the step runs once over exactly those tokens, and experts no token chose cost nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from kvyard.models.config import MoeConfig
from kvyard.models.expert_residency import ExpertResidency
from kvyard.models.layers import GatedMLP, Linear


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        self.top_k = moe.experts_per_token
        self.normalize = moe.normalize_top_k
        self.moe = moe
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)  # the router
        # DeepSeek-V3: added to the scores to choose experts, never to weight them
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.selection_bias else None
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.expert_intermediate_size) for _ in range(moe.num_experts)
        )
        # The shared expert: every token's; Qwen2-MoE scales its output by a sigmoid gate of the token
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size)
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        # Experts kept out of memory (expert_residency): this layer's number there, and the next expert layer,
        # whose router guesses from this layer's input which of its experts to read ahead.
        self.residency: ExpertResidency | None = None
        self.layer_index = -1
        self.following: tuple[SparseMoE, ...] = ()  # a tuple: a module attribute would register it as a child

    def page_experts(self, residency: ExpertResidency, layer_index: int, following: SparseMoE | None) -> None:
        """Take the routed experts' weights from `residency`, which holds them as `layer_index`."""
        self.residency, self.layer_index = residency, layer_index
        self.following = (following,) if following is not None else ()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts): each token's chosen experts and the weights of their outputs."""
        if self.moe.scoring == "sigmoid":
            return self._route_by_groups(x)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _route_by_groups(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing (MoeConfig), in fp32."""
        moe = self.moe
        scores = torch.sigmoid(self.gate(x).float())
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
        if moe.num_groups > 1:
            per_group = self.num_experts // moe.num_groups
            group_scores = choice.view(-1, moe.num_groups, per_group).topk(2, dim=-1).values.sum(dim=-1)
            kept = torch.topk(group_scores, moe.top_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~mask.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * moe.routed_scaling).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.residency is not None:
            self._read_ahead(x, experts)
        # One token (a single stream's decode step) has no grouping to do.
        out = self._one_token(x, weights[0], experts[0]) if x.shape[0] == 1 else self._grouped(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            out = out + (torch.sigmoid(gate(x)) * shared if gate is not None else shared)
        return out

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The grouped sum's bits for one token: its experts' outputs added in the experts' order, as index_add_
        adds them."""
        out = None
        for expert, weight in sorted(zip(experts.tolist(), weights.tolist())):
            if self.residency is not None:
                self.residency.use(self.layer_index, expert)
            term = self.experts[expert](x) * weight
            out = term if out is None else out + term
        assert out is not None
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        picks = experts.flatten()  # token t's k-th pick at t * top_k + k
        order = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=self.num_experts).tolist()
        pick_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for number, (expert, count) in enumerate(zip(self.experts, counts)):
            if not count:
                continue
            chosen = order[start : start + count]
            start += count
            tokens = chosen // self.top_k
            if self.residency is not None:
                self.residency.use(self.layer_index, number)
            out.index_add_(0, tokens, expert(x[tokens]) * pick_weights[chosen, None])
        return out

    def _read_ahead(self, x: torch.Tensor, experts: torch.Tensor) -> None:
        """Tell the residency which experts this layer runs (in its order), and which the next expert layer's
        router would pick for this layer's input: its likely picks, read while this layer computes."""
        assert self.residency is not None
        self.residency.want(self.layer_index, torch.unique(experts).tolist())
        for following in self.following:
            guessed = following.route(x)[1]
            self.residency.prefetch(following.layer_index, torch.unique(guessed).tolist())

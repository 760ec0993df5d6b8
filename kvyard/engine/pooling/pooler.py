"""The torch side of pooling requests (kvyard.engine.pooling.params): hidden states into embeddings and scores."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvyard.engine.pooling.params import PoolingParams


@dataclass(slots=True)
class PromptPooler:
    """Pools the hidden states of pooling requests as their prompt chunks run: mean pooling keeps a running sum
    per request across chunks (restarted when a preempted prompt is computed again from its first position)."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def add_chunk(self, request_id: str, hidden: torch.Tensor, first_position: int) -> None:
        chunk_sum = hidden.sum(dim=0, dtype=torch.float64)
        if first_position == 0 or request_id not in self.sums:
            self.sums[request_id] = chunk_sum
        else:
            self.sums[request_id] += chunk_sum

    def embedding(self, request_id: str, params: PoolingParams, last: torch.Tensor, num_positions: int) -> list[float]:
        mean = params.method == "mean"
        vector = self.sums.pop(request_id) / num_positions if mean else last.to(torch.float64)
        if params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return [float(value) for value in vector.float().tolist()]

    def release(self, request_id: str) -> None:
        self.sums.pop(request_id, None)


def choice_score(logits: torch.Tensor, choice_token_ids: tuple[int, int]) -> float:
    """P(second token) among the two, from one position's logits."""
    pair = logits[list(choice_token_ids)].to(torch.float64)
    return float(torch.softmax(pair, dim=0)[1])

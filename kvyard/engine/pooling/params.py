"""Prompt-only requests that return a vector instead of tokens: an embedding of the prompt's final hidden states,
or a score, the model's probability of one answer token over another after the prompt (yes/no rerankers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What the engine computes for a pooling request once its whole prompt has run.

    `method` "last": the final hidden state of the last prompt token (decoder embedding models, as
    Qwen3-Embedding); "mean": the mean over every prompt position (the prompt is then computed whole, never
    taken from the prefix cache). `normalize`: the vector scaled to unit length. `choice_token_ids` (no, yes):
    a score, softmax over those two logits at the last position, instead of an embedding."""

    method: Literal["last", "mean"] = "last"
    normalize: bool = True
    choice_token_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")

    @property
    def reads_every_position(self) -> bool:
        return self.choice_token_ids is None and self.method == "mean"

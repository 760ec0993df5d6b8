"""What a step hands to the model and gets back: the `Runner` that computes a scheduled batch (a model on a device,
or the simulator's cost model) and the token it returns for each request a step completes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvyard.engine.sampling.logprobs import TokenLogprobs
from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A request's next token, or (token_id -1) a pooling request's result."""

    request: Request
    token_id: int
    logprobs: TokenLogprobs | None = None
    pooled: list[float] | None = None


class Runner(Protocol):
    """Computes scheduled batches: a model on a device, or a cost model in the simulator."""

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        """Compute every scheduled token (decodes come first in `scheduled`); return a token for each item
        that completes its sequence, in order. Request state is as before the step."""
        ...

    def release(self, request: Request) -> None:
        """The request has finished or was aborted: drop anything kept for it."""
        ...

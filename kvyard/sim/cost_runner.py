"""The simulator's runner: the engine core's `Runner` with a cost model where the model would be.

A step computes nothing; it costs `CostModel.step_seconds` of the batch's shape, and every request
whose known tokens are all computed gets its next token from `tokens.output_token`, a deterministic
function of the request, so equal requests get equal answers in every process.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest
from kvyard.engine.scheduling.step import SampledToken
from kvyard.sim.cost_model import CostModel, StepShape, prefill_pairs
from kvyard.sim.tokens import output_seed, output_token


class CostRunner:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.num_steps = 0
        self.last_step_seconds = 0.0
        self._seeds: dict[str, int] = {}

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> list[SampledToken]:
        self.num_steps += 1
        self.last_step_seconds = self.cost.step_seconds(step_shape(scheduled))
        return [
            SampledToken(item.request, self._next_token(item.request)) for item in scheduled if item.completes_sequence
        ]

    def release(self, request: Request) -> None:
        self._seeds.pop(request.request_id, None)

    def _next_token(self, request: Request) -> int:
        seed = self._seeds.get(request.request_id)
        if seed is None:
            seed = self._seeds[request.request_id] = output_seed(request.prompt_token_ids, request.sampling_params.seed)
        return output_token(seed, request.num_output_tokens)


def step_shape(scheduled: Sequence[ScheduledRequest]) -> StepShape:
    """What a step computes: decode tokens of running sequences, prefill chunks of the others."""
    prefill_tokens = pairs = decode_seqs = decode_context = 0
    for item in scheduled:
        request = item.request
        if item.num_new_tokens == 1 and request.num_output_tokens > 0 and item.completes_sequence:
            decode_seqs += 1
            decode_context += request.num_tokens
        else:
            prefill_tokens += item.num_new_tokens
            pairs += prefill_pairs(item.num_new_tokens, request.num_computed_tokens)
    return StepShape(prefill_tokens, pairs, decode_seqs, decode_context)

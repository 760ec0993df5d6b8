"""The engine's speculation, step by step: which running requests propose how many tokens, what verifying them
costs here, and what the model kept (the policy's estimates and the counters `/metrics` shows)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvyard.api.checks import ContextLimits
from kvyard.engine.scheduling.request import Request
from kvyard.engine.scheduling.scheduler import ScheduledRequest
from kvyard.engine.speculative.policy import (
    INITIAL_ACCEPTANCE,
    MAX_PROBE_INTERVAL,
    PROBE_EVERY,
    Proposer,
    SpeculativeConfig,
    StepCost,
    can_speculate,
    num_tokens_to_propose,
    updated_acceptance,
)


@dataclass(slots=True)
class Speculation:
    """A proposer steered by measured costs and acceptance; one per engine."""

    config: SpeculativeConfig
    limits: ContextLimits
    proposer: Proposer
    acceptance: float = INITIAL_ACCEPTANCE  # over all requests: where a new request's estimate starts
    num_proposed: int = 0
    num_accepted: int = 0
    num_verifications: int = 0
    step_cost: StepCost = field(default_factory=StepCost)

    def propose(self, running: Sequence[Request]) -> None:
        """Proposed tokens for every running request that can speculate this step (none for the others)."""
        wanted, vocab = self.config.num_speculative_tokens, self.limits.vocab_size
        eligible = [request for request in running if can_speculate(request)]
        token_cost = self._proposal_cost(len(eligible))

        def embeddable(token_id: int) -> bool:  # a token the model cannot embed is no guess: stop before it
            return 0 <= token_id < vocab

        for request in running:
            request.spec_token_ids = []
        rooms = [
            min(
                self._num_to_propose(request, wanted, token_cost),
                self.limits.max_model_len - request.num_tokens - 1,
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
            )
            for request in eligible
        ]
        if not any(room > 0 for room in rooms):
            return
        for request, room, proposed in zip(eligible, rooms, self.proposer.propose(eligible, rooms)):
            request.spec_token_ids = list(itertools.takewhile(embeddable, proposed[: max(room, 0)]))

    def num_computed(self, item: ScheduledRequest, num_emitted: int) -> int:
        """Tokens of a verified `item` whose KV is now right: all it scheduled, less the proposals the model
        rejected; the acceptance estimates and counters learn the outcome."""
        accepted = num_emitted - 1
        proposed = len(item.spec_token_ids)
        item.request.spec_acceptance = updated_acceptance(item.request.spec_acceptance, proposed, accepted)
        self.acceptance = updated_acceptance(self.acceptance, proposed, accepted)
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verifications += 1
        return item.num_new_tokens - proposed + accepted

    def observe_step(self, scheduled: Sequence[ScheduledRequest], seconds: float) -> None:
        """A step's time, for the fit that prices verifying a token: decode and verify steps only."""
        if all(item.num_new_tokens - len(item.spec_token_ids) == 1 for item in scheduled):
            self.step_cost.observe(sum(item.num_new_tokens for item in scheduled), seconds)

    def _proposal_cost(self, num_sequences: int) -> float:
        """What one more proposed token per sequence adds to a step, as a fraction of a decode step of
        `num_sequences`: verifying it, plus producing it when the proposer runs a model."""
        verify = self.step_cost.verify_token_cost(num_sequences) or self.config.verify_token_cost
        proposal_s = self.proposer.seconds_per_proposal(num_sequences)
        step_s = self.step_cost.step_seconds(num_sequences) if proposal_s else None
        return verify + (proposal_s / step_s if step_s else 0.0)

    def _num_to_propose(self, request: Request, wanted: int, token_cost: float) -> int:
        if not self.config.adaptive:
            return wanted
        num = num_tokens_to_propose(request.spec_acceptance, wanted, token_cost)
        if num:
            request.spec_idle_steps = 0
            request.spec_probe_interval = PROBE_EVERY
            return num
        if num_tokens_to_propose(1.0, wanted, token_cost) == 0:
            return 0  # not even guesses that are always right would pay at this cost: nothing to probe for
        request.spec_idle_steps += 1
        if request.spec_idle_steps < request.spec_probe_interval:
            return 0
        request.spec_idle_steps = 0
        request.spec_probe_interval = min(2 * request.spec_probe_interval, MAX_PROBE_INTERVAL)
        return 1

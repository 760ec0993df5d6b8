"""Prefill/decode disaggregation in the router: pick a decode replica, decide whether a prefill replica prefills
for it, and build the two legs (docs/contracts.md §6).

The decode replica is chosen first, cache-aware over the decode pool: the replica that holds the session's
history has the least to compute or pull, and the cost model spreads load as it does for unified replicas.
Then, per request, **conditional disaggregation**: when the tokens the decode replica would have to compute
(the prompt minus what it holds) are few, it prefills them itself; moving KV for a continuing turn whose
history is already there costs more than it saves. It also prefills a prompt itself when the prefill pool would
start it later (a burst), as long as the prefill work queued on it stays within `pd_decode_prefill_budget`, which
bounds what its running streams pay for it. Otherwise a prefill replica is chosen, cache-aware over the
prefill pool, among those whose block namespace (model, weights digest, dtype, block size) equals the decode
replica's: blocks of another model are never mixed in, and a fleet where no such pair exists gets a clear
error rather than a silent fallback. Both legs go out at once with one fresh transfer id; the decode replica
pulls blocks while the prefill replica computes them, and falls back to computing them itself on any failure.

Decode replicas hold every running sequence's KV, so their pool fills first: a decode replica is a candidate only
while its KV room (its pool less the tokens its running sequences hold, as last reported, and those of requests
sent there since) fits the request's prompt and asked output. When none does, a conditional router runs the
request whole on a prefill replica with room (`decode_full`) instead of queueing it, or making a decode replica
preempt and recompute, behind a full pool; replicas that do not report their pool always count as having room.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

from kvyard.api.errors import APIError
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.router.config import RouterConfig
from kvyard.router.holders import KeyHolders
from kvyard.router.policies import CacheAware, Decision, RouteRequest
from kvyard.router.replica import Replica
from kvyard.router.tier_index import SharedStores
from kvyard.router.tokens import max_tokens_asked

PREFILL, DECODE, UNIFIED = "prefill", "decode", "unified"
# What a pulled token costs the decode replica (receive, verify, copy: the prefill replica did the compute), in
# prefill-token equivalents. A rough figure: it only has to be small next to a running request's cost
# (RouterConfig.running_request_cost), so that decodes spread by load rather than by who holds a prefix.
PULL_TOKEN_COST = 0.05


@dataclass(slots=True)
class PDPlan:
    decode: Decision
    prefill: Decision | None  # None: the decode replica prefills the request itself
    reason: str  # remote | short | prefill_busy (sooner here) | no_prefill_replica | decode_full (no KV room)
    transfer_id: str = ""
    transfer_token: str = ""  # what the decode replica shows the prefill replica, instead of any key of its own

    def decode_fields(self) -> dict[str, Any]:
        """`kv_transfer_params` of the decode leg."""
        assert self.prefill is not None
        return {
            "do_remote_prefill": True,
            "transfer_id": self.transfer_id,
            "source": self.prefill.replica.url,
            "transfer_token": self.transfer_token,
        }


@dataclass(slots=True)
class PDPlanner:
    config: RouterConfig
    decode_policy: CacheAware  # a decode replica that prefills the request itself
    remote_decode_policy: CacheAware  # one that pulls the prompt: running decodes weigh more than pulled tokens
    prefill_policy: CacheAware

    @classmethod
    def create(
        cls, config: RouterConfig, shared_stores: SharedStores | None = None, holders: KeyHolders | None = None
    ) -> PDPlanner:
        shared_stores = shared_stores if shared_stores is not None else SharedStores()
        remote = dataclasses.replace(config, running_request_cost=config.pd_decode_request_cost)
        return cls(
            config,
            CacheAware(config, shared_stores, holders),
            CacheAware(remote, shared_stores, holders),
            CacheAware(config, shared_stores, holders),
        )

    def plan(self, request: RouteRequest, candidates: list[Replica]) -> PDPlan:
        needed = kv_tokens_asked(request)
        plan = self._plan(request, candidates, needed)
        plan.decode.kv_tokens = needed
        return plan

    def _plan(self, request: RouteRequest, candidates: list[Replica], needed: int) -> PDPlan:
        decoders = [r for r in candidates if r.role in (DECODE, UNIFIED)] or candidates
        prefillers = [r for r in candidates if r.role == PREFILL]
        if not prefillers:
            return PDPlan(self.decode_policy.choose(request, decoders), None, "no_prefill_replica")
        roomy = [r for r in decoders if has_kv_room(r, needed)]
        if not roomy and self.config.disaggregation == "conditional":
            spare = [r for r in prefillers if has_kv_room(r, needed)]
            if spare:
                return PDPlan(self.decode_policy.choose(request, spare), None, "decode_full")
        decoders = roomy or decoders
        if self._local_candidate(request, decoders):
            decode = self.decode_policy.choose(request, decoders)
            if self._short(request, decode):
                return PDPlan(decode, None, "short")
        else:
            # The prompt is prefilled elsewhere: what a decode replica lacks costs it a transfer, not a prefill,
            # so decodes spread by load instead of crowding onto whichever replica holds a popular prefix.
            decode = self.remote_decode_policy.choose(request, decoders, self._pull_cost)
        compatible = [
            r for r in prefillers if r is not decode.replica and same_kv(r.namespace, decode.replica.namespace)
        ]
        if not compatible:
            raise APIError(503, _mismatch_message(decode.replica, prefillers), code="pd_model_mismatch")
        if (
            self.config.disaggregation == "conditional"
            and request.token_ids
            and self._prefill_pool_busy(request, decode, compatible)
        ):
            decode.prefill_cost = self._local_prefill_cost(request, decode)
            return PDPlan(decode, None, "prefill_busy")
        prefill = self.prefill_policy.choose(request, compatible)
        return PDPlan(decode, prefill, "remote", secrets.token_hex(16), secrets.token_urlsafe(24))

    def _prefill_pool_busy(self, request: RouteRequest, decode: Decision, prefillers: list[Replica]) -> bool:
        """The prompt would start sooner on the decode replica than behind the prefill pool's queue (predicted
        costs, prefill-token equivalents; a tie goes to the prefill pool), and prefilling it there keeps the
        prefill work queued on a replica that runs decodes within `pd_decode_prefill_budget`: under a burst the
        decode pool lends the prefill pool a hand, at a bounded price in inter-token latency."""
        replica, policy = decode.replica, self.decode_policy
        local_cost = self._local_prefill_cost(request, decode)
        ahead = policy.prefill_ahead(replica)
        decoding = max(replica.load.num_running, replica.streaming, replica.awaiting_first_byte) > 0
        if decoding and ahead + local_cost > self.config.pd_decode_prefill_budget:
            return False
        tokens = len(request.token_ids or ())
        remote = min(
            self.prefill_policy.queue_cost(p)
            + policy.prefill_cost(tokens - (cached := policy.predicted_cached_tokens(request, p) or 0), cached)
            for p in prefillers
        )
        return remote > ahead + local_cost

    def _local_prefill_cost(self, request: RouteRequest, decode: Decision) -> float:
        cached = decode.predicted_cached_tokens or 0
        return self.decode_policy.prefill_cost(len(request.token_ids or ()) - cached, cached)

    def _local_candidate(self, request: RouteRequest, decoders: list[Replica]) -> bool:
        """Some decode replica holds enough of the prompt to prefill the rest itself (conditional mode)."""
        if self.config.disaggregation != "conditional" or not request.token_ids:
            return False
        most = max((self.decode_policy.predicted_cached_tokens(request, r) or 0) for r in decoders)
        return len(request.token_ids) - most <= self.config.pd_local_prefill_tokens

    @staticmethod
    def _pull_cost(num_new: int, num_cached: int) -> float:
        return PULL_TOKEN_COST * num_new

    def _short(self, request: RouteRequest, decode: Decision) -> bool:
        """Few enough tokens to compute that the decode replica prefills them itself (conditional mode)."""
        if self.config.disaggregation != "conditional" or request.token_ids is None:
            return False
        to_compute = len(request.token_ids) - (decode.predicted_cached_tokens or 0)
        return to_compute <= self.config.pd_local_prefill_tokens


def kv_tokens_asked(request: RouteRequest) -> int:
    """KV tokens a request will hold on its decode replica: its prompt and the output it asks for at most (0 when
    the router has no token ids for it)."""
    if not request.token_ids:
        return 0
    return len(request.token_ids) + max_tokens_asked(request.body, 0)


def has_kv_room(replica: Replica, tokens: int) -> bool:
    """The replica's KV pool can take `tokens` more: its size less what its running sequences held at its last load
    report and what the router sent there since (still awaiting a first byte). True when it reports no pool."""
    load, namespace = replica.load, replica.namespace
    if load.kv_blocks_total <= 0 or namespace is None:
        return True
    room = load.kv_blocks_total * namespace.block_size - load.tokens_in_flight - replica.pending_kv_tokens
    return tokens <= room


def same_kv(left: KeyNamespace | None, right: KeyNamespace | None) -> bool:
    """Blocks of one can be used by the other: same model identity, dtype and block size (any salt)."""
    if left is None or right is None:
        return False
    return (left.model_name, left.model_digest, left.dtype, left.block_size) == (
        right.model_name,
        right.model_digest,
        right.dtype,
        right.block_size,
    )


def _mismatch_message(decode: Replica, prefillers: list[Replica]) -> str:
    def describe(replica: Replica) -> str:
        ns = replica.namespace
        if ns is None:
            return f"{replica.url} (namespace unknown: no KV snapshot yet, or no --replica-admin-key)"
        return f"{replica.url} ({ns.model_name}, weights {ns.model_digest[:12]}, {ns.dtype}, block {ns.block_size})"

    return (
        f"no prefill replica serves the same KV as decode replica {describe(decode)}: "
        f"{'; '.join(describe(r) for r in prefillers)}. Disaggregation needs the same model, weights, dtype "
        "and block size on both sides"
    )


def prefill_leg(kind: str, body: dict[str, Any], transfer_id: str, transfer_token: str) -> dict[str, Any]:
    """The prefill replica's request: the prompt, one token, one choice, no stream; it keeps the blocks."""
    dropped = ("n", "stream", "stream_options", "stream_progress", "resume", "best_of", "logprobs", "top_logprobs")
    leg = {key: value for key, value in body.items() if key not in dropped}
    leg["max_tokens"] = 1
    if kind == "chat":
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id, "transfer_token": transfer_token}
    return leg

"""The engine's core: requests, scheduling, prefix cache and stopping, with the model behind a `Runner`.

Every step the scheduler picks a batch (decode tokens and prefill chunks under a token budget), the
runner computes it and returns one sampled token for every request whose known tokens are now all
computed, and the core registers the newly full blocks in the prefix cache, appends the tokens and
decides which requests stop. The core imports no torch: `ModelRunner` (a real model) and the
simulator's `CostRunner` (a cost model) plug into the same loop, so the simulator schedules, caches
and evicts exactly as the engine does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvyard.api.checks import ContextLimits, check_kv_room, check_prompt, check_sampling_token_ids, check_token_ids
from kvyard.api.errors import InputError
from kvyard.api.kv_events import BlendAdvert
from kvyard.engine.blend.settings import BlendSettings
from kvyard.engine.kv_links.exports import BlockReader, ExportRead, KVExports, read_export
from kvyard.engine.measured_costs import MeasuredCosts
from kvyard.engine.pooling.params import PoolingParams
from kvyard.engine.sampling.bad_words import bad_words_token_ids
from kvyard.engine.sampling.detokenizer import IncrementalDetokenizer, Tokenizer
from kvyard.engine.sampling.logprobs import TokenLogprobs
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.sampling.structured_output import Grammars
from kvyard.engine.scheduling.block_pool import BlockPool
from kvyard.engine.scheduling.kv_cache_manager import BlockPuller, BlockTier, KVCacheManager
from kvyard.engine.scheduling.request import KVTransferParams, Request, RequestStatus
from kvyard.engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from kvyard.engine.scheduling.step import Runner, SampledToken
from kvyard.engine.speculative.policy import INITIAL_ACCEPTANCE, Proposer, SpeculativeConfig, make_proposer
from kvyard.engine.speculative.speculation import Speculation
from kvyard.kvcache.block_key import KeyNamespace
from kvyard.kvcache.events import KVEventLog

_LOG = logging.getLogger(__name__)
IDLE_LOAD_WAIT_S = 0.01


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """The limits the core enforces; `EngineConfig` and `SimConfig` derive them."""

    limits: ContextLimits
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True
    record_kv_events: bool = False
    event_log_capacity: int = 65536
    kv_lease_s: float = 30.0  # how long a finished prefill's blocks stay pinned for a decode replica's pull
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    non_prefix_reuse: str = "off"  # "blend": requests blend moved text's KV unless they say otherwise
    blend: BlendSettings = field(default_factory=BlendSettings)  # how a request that blends does it

    @property
    def block_size(self) -> int:
        return self.limits.block_size


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """time.monotonic() stamps of a request's life, for latency metrics (TTFT = first_token - arrival)."""

    arrival: float
    first_token: float | None
    finished: float | None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, the first None
    stop_reason: int | str | None = None
    times: RequestTimes | None = None
    num_local_tier_tokens: int = 0  # of the cached tokens, loaded from the replica's own lower tiers
    num_shared_tier_tokens: int = 0  # of the cached tokens, loaded from the shared store
    num_blended_tokens: int = 0  # prompt tokens (not counted as cached) whose KV came from moved text, blended
    pooled: list[float] | None = None  # a pooling request's embedding, or its score as one value

    def merge(self, later: RequestOutput) -> RequestOutput:
        """`later` (the same request's next output) with this one's new tokens and text in front of its own."""
        later.new_token_ids = self.new_token_ids + later.new_token_ids
        later.new_text = self.new_text + later.new_text
        return later


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The core's counters at one moment; what load reports and gauges are made of."""

    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_in_flight: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_tier_hit_tokens: int
    num_preemptions: int
    kv_shared_hit_tokens: int = 0
    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, the ones the model agreed with (each saves a decode step)
    spec_verifications: int = 0  # request-steps that verified proposals (accepted / this: mean accepted run)
    prefill_s_per_token: float | None = None  # recent step seconds per token of steps that prefilled
    tier_s_per_block: dict[str, float] = field(default_factory=dict)  # recent load seconds per block, by medium
    shared_tier_available: bool = True
    tier_load_deadline_s: float = 0.0  # 0: no tier
    tier_load_extension_s_per_block: float = 0.0  # a load's deadline moves back this much per block it brings


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The cached block keys and the KV-event sequence number they are current at."""

    seq: int
    block_keys: list[bytes]
    namespace: KeyNamespace
    local_keys: list[bytes] = field(default_factory=list)  # held by the replica's own lower tiers
    shared_store: tuple[str, float | None] | None = None  # the shared store's id and block TTL
    segments: dict[bytes, int] | None = None  # block key -> segment fingerprint, where this core blends
    blend: BlendAdvert | None = None


class EngineCore:
    generates = True  # False: an embedding checkpoint without an LM head, which only pools prompts

    def __init__(
        self,
        config: CoreConfig,
        namespace: KeyNamespace,
        runner: Runner,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Iterable[int] = (),
        proposer: Proposer | None = None,
    ) -> None:
        """`proposer`: the speculative proposer when it runs a model (the engine on the model builds it); else
        the one `config.speculative` names is made here."""
        if namespace.block_size != config.block_size:
            raise ValueError(f"namespace block size {namespace.block_size} != engine's {config.block_size}")
        self.config = config
        self.limits = config.limits
        self.namespace = namespace
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._events = KVEventLog(config.event_log_capacity) if config.record_kv_events else None
        self.block_pool = BlockPool(config.limits.num_kv_blocks, config.enable_prefix_caching, self._events)
        self.kv_manager = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.kv_exports = KVExports(self.block_pool, config.kv_lease_s, max_pinned=self.block_pool.num_blocks // 2)
        self.block_reader: BlockReader | None = None  # set by engines whose blocks can be sent to other replicas
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._root_keys: dict[str, bytes] = {}
        self.speculation: Speculation | None = None
        self.proposer = proposer if proposer is not None else make_proposer(config.speculative)
        self.costs = MeasuredCosts()
        self.grammars = Grammars(tokenizer, config.limits.vocab_size)  # compiled on the first constrained request
        self._enable_blending()

    def adopt_core_state(self, other: EngineCore) -> None:
        """Take over another core's requests, blocks, prefix cache, event log and counters, as they are between
        two of its steps: this core steps on from there with its own runner (which must read the same KV
        memory). The other core must not step again."""
        for name in _CORE_STATE:
            setattr(self, name, getattr(other, name))
        self._enable_blending()

    def _enable_blending(self) -> None:
        """Index computed blocks by their tokens where this core's runner can blend them into other prompts (a
        runner on a model; the simulator's has no keys and values to move). Blocks computed before are not."""
        if getattr(self.runner, "blends", False):
            self.kv_manager.enable_segments()

    @property
    def proposer(self) -> Proposer | None:
        return self.speculation.proposer if self.speculation is not None else None

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        """Speculate with `proposer` from the next step on (None: stop speculating)."""
        if proposer is None:
            self.speculation = None
        elif self.speculation is None:
            self.speculation = Speculation(self.config.speculative, self.limits, proposer)
        else:
            self.speculation.proposer = proposer

    @property
    def model_name(self) -> str:
        return self.namespace.model_name

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        resumed_output_ids: Sequence[int] = (),
        kv_transfer: KVTransferParams | None = None,
        pooling: PoolingParams | None = None,
    ) -> Request:
        """Queue a request. `resumed_output_ids`: output another replica generated before it failed; they are
        prefilled with the prompt, count toward `max_tokens`, and generation continues after them.
        `kv_transfer`: prefill it for another replica, or pull its prompt's blocks from one (docs/contracts.md §6).
        `pooling`: compute the prompt only and answer with an embedding or a score (`params` then unused)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        export_id = kv_transfer.export_id if kv_transfer is not None else None
        if export_id is not None and export_id in self.kv_exports:
            raise InputError(f"transfer id {export_id!r} is already in use", "kv_transfer_params.transfer_id")
        check_prompt(prompt_token_ids, self.limits)
        check_kv_room(len(prompt_token_ids), params.max_tokens, self.limits)
        check_sampling_token_ids(params.stop_token_ids, list(params.logit_bias), self.limits.vocab_size)
        self._check_priority(params.priority)
        bad_words = self._bad_words_token_ids(params.bad_words)
        if resumed_output_ids:
            self._check_resume(len(prompt_token_ids), resumed_output_ids, params)
        if not self.generates and (pooling is None or pooling.choice_token_ids is not None):
            message = "this model has no language-model head (an embedding checkpoint): it serves /v1/embeddings only"
            raise InputError(message, "model", "model_cannot_generate")
        if pooling is not None and (kv_transfer is not None or resumed_output_ids):
            raise ValueError("a pooling request neither disaggregates nor resumes")
        detokenizer = self._make_detokenizer(params) if pooling is None else None
        if detokenizer is not None:
            for token_id in resumed_output_ids:
                detokenizer.push(token_id)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(resumed_output_ids),
            sampling_params=params,
            cache_root_key=self.root_key(cache_salt),
            block_size=self.config.block_size,
            stop_token_ids=self._stop_token_ids(params),
            kv_transfer=kv_transfer,
            spec_acceptance=self.speculation.acceptance if self.speculation else INITIAL_ACCEPTANCE,
            pooling=pooling,
            bad_words_token_ids=bad_words,
            blend=self._blend_of(params, kv_transfer),
        )
        if params.structured is not None:
            request.grammar = self.grammars.matcher(params.structured, resumed_output_ids)
        if export_id is not None:
            self.kv_exports.open(request, export_id)
        self._requests[request_id] = request
        if detokenizer is not None:
            self._detokenizers[request_id] = detokenizer
        self.scheduler.add(request)
        return request

    def _blend_of(self, params: SamplingParams, kv_transfer: KVTransferParams | None) -> BlendSettings | None:
        """How the request blends moved text, if it does: its own choice, else the engine's; never across a
        prefill/decode split (the decode side takes the prefill side's blocks as they are)."""
        wanted = (params.non_prefix_reuse or self.config.non_prefix_reuse) == "blend"
        return self.config.blend if wanted and kv_transfer is None else None

    def _check_resume(self, num_prompt_tokens: int, resumed_output_ids: Sequence[int], params: SamplingParams) -> None:
        check_token_ids(resumed_output_ids, self.limits.vocab_size, "resume.token_ids", "resume.token_ids")
        if len(resumed_output_ids) >= params.max_tokens:
            raise InputError(
                f"resume.token_ids holds {len(resumed_output_ids)} tokens; max_tokens={params.max_tokens} "
                "leaves none to generate",
                "resume.token_ids",
            )
        if num_prompt_tokens + len(resumed_output_ids) >= self.limits.max_model_len:
            raise InputError(
                "the prompt plus resume.token_ids fill the model's context",
                "resume.token_ids",
                "context_length_exceeded",
            )

    def _check_priority(self, priority: int) -> None:
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise InputError(
                f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
                f"priority); this engine schedules {self.config.scheduler.scheduling_policy}",
                "priority",
            )

    def _bad_words_token_ids(self, words: Sequence[str]) -> list[tuple[int, ...]]:
        if not words:
            return []
        if self.tokenizer is None:
            raise InputError("bad_words need a tokenizer, and this model directory has none", "bad_words")
        return bad_words_token_ids(words, self.tokenizer, self.limits.vocab_size)

    def root_key(self, cache_salt: str | None) -> bytes:
        """The namespace root of a tenant's block keys."""
        salt = cache_salt or ""
        key = self._root_keys.get(salt)
        if key is None:
            if len(self._root_keys) >= 4096:  # a bound, not a policy: salts are cheap to recompute
                self._root_keys.clear()
            key = self._root_keys[salt] = self.namespace.with_salt(salt).root_key()
        return key

    def _make_detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            if params.stop:
                raise ValueError("stop strings need a tokenizer, and this model directory has none")
            return None
        return IncrementalDetokenizer(
            self.tokenizer, list(params.stop), params.include_stop_str_in_output, params.skip_special_tokens
        )

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.eos_token_ids)
        return frozenset(stop)

    def abort_request(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that produced tokens."""
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        schedule = self.scheduler.schedule()
        if not schedule.scheduled:  # maybe every waiting request waits for KV-tier blocks: wait, don't spin
            idle_wait = IDLE_LOAD_WAIT_S if self.kv_manager.load_wait_s else 0.0
            self.kv_manager.wait_for_loads(self.scheduler.waiting, idle_wait)
            self.housekeeping()
            return []
        # decodes first (a verification runs as one decode query per position), then prefill chunks
        scheduled = sorted(schedule.scheduled, key=lambda s: s.num_new_tokens - len(s.spec_token_ids) != 1)
        started = time.perf_counter()
        sampled = self.runner.execute(scheduled)
        self._measure_step(scheduled, time.perf_counter() - started)
        by_request: dict[str, list[SampledToken]] = {}
        for token in sampled:
            by_request.setdefault(token.request.request_id, []).append(token)
        for item in scheduled:
            num_emitted = len(by_request.get(item.request.request_id, ()))
            item.request.num_computed_tokens += self._num_computed(item, num_emitted)
            self.kv_manager.register_computed_blocks(item.request)
            if item.request.kv_transfer is not None and item.request.kv_transfer.export_id is not None:
                self.kv_exports.offer(item.request)
        now = time.monotonic()
        outputs = [self._accept_tokens(tokens, now) for tokens in by_request.values()]
        self.housekeeping(now)
        return outputs

    def _num_computed(self, item: ScheduledRequest, num_emitted: int) -> int:
        """Tokens of `item` whose KV is now right: all it scheduled, less the proposals the model rejected."""
        if not item.spec_token_ids or self.speculation is None:
            return item.num_new_tokens
        return self.speculation.num_computed(item, num_emitted)

    def _measure_step(self, scheduled: Sequence[ScheduledRequest], wall_s: float) -> None:
        """What the step cost (a modeled runner states its time): for the router's predicted TTFT, the tier's
        load-or-compute choice and speculation's verify cost."""
        seconds = getattr(self.runner, "last_step_seconds", wall_s)
        if any(item.segments for item in scheduled):
            return  # a blend computes a fraction of its tokens: its step says nothing of a token's cost
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        self.costs.observe_step(num_tokens, seconds, self.config.block_size, self.kv_manager.tier)
        if self.speculation is not None:
            self.speculation.observe_step(scheduled, seconds)

    def use_compute_threads(self) -> None:
        """On the thread that runs this engine's steps, before its first: take the threads a server reserved for
        its engine (kvyard.kernels.threads). Nothing here: the fast-start engine's kernels are given their
        thread count; LLMEngine's PyTorch takes it."""

    def housekeeping(self, now: float | None = None) -> None:
        """Time-driven upkeep, also while idle: end the leases of transfers nobody released, free the blocks
        reserved for pulls whose request went away, and unpin those that finished pulls wrote."""
        if self.kv_exports.num_active:
            self.kv_exports.expire(now)
        self.kv_manager.reap_orphaned_loads()
        self.kv_manager.settle_written_pulls(self.scheduler.waiting)

    def _accept_tokens(self, tokens: list[SampledToken], now: float) -> RequestOutput:
        """Append one request's tokens of this step (several when speculation was accepted), up to the one that
        finishes it."""
        request = tokens[0].request
        if request.first_token_time is None:
            request.first_token_time = now
        if tokens[0].pooled is not None:
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            output = _output(request, [], "", "")
            output.pooled = tokens[0].pooled
            return output
        detokenizer = self._detokenizers.get(request.request_id)
        new_ids: list[int] = []
        new_text = ""
        for token in tokens:
            request.append_token(token.token_id)
            new_ids.append(token.token_id)
            if token.logprobs is not None:
                request.output_logprobs.append(token.logprobs)
            stop_string = None
            if detokenizer is not None:
                text, stop_string = detokenizer.push(token.token_id)
                new_text += text
            status = self._finish_status(request, token.token_id, stop_string)
            if status is not None:
                if detokenizer is not None and stop_string is None:
                    new_text += detokenizer.finish()
                self._finish(request, status)
                break
        text = detokenizer.text if detokenizer is not None else ""
        return _output(request, new_ids, text, new_text)

    def _finish_status(self, request: Request, token_id: int, stop_string: str | None) -> RequestStatus | None:
        params = request.sampling_params
        if stop_string is not None:
            request.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_token_ids and request.num_output_tokens >= params.min_tokens:
            request.stop_reason = token_id if token_id not in self.eos_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and self._grammar_ends(request, token_id):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _grammar_ends(self, request: Request, token_id: int) -> bool:
        """Advance the request's grammar past `token_id`: True when nothing more may follow (the output is a
        complete sentence), or, which the sampler's mask rules out, when the grammar refuses the token."""
        assert request.grammar is not None
        if not request.grammar.accept(token_id):
            _LOG.error(
                "request %s: token %d breaks its grammar (%s); ending it",
                request.request_id,
                token_id,
                request.grammar.error,
            )
            return True
        return request.grammar.is_finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.kv_transfer is not None and request.kv_transfer.export_id is not None:
            self.kv_exports.offer(request)
            self.kv_exports.finish(request, completed=status is not RequestStatus.FINISHED_ABORTED)
        self.scheduler.finish(request, status)
        self.runner.release(request)
        if self.proposer is not None:
            self.proposer.release(request)
        del self._requests[request.request_id]
        self._detokenizers.pop(request.request_id, None)

    # ----------------------------------------------------------------- cache and statistics

    def stats(self) -> EngineStats:
        scheduler, kv, speculation = self.scheduler, self.kv_manager, self.speculation
        return EngineStats(
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            kv_blocks_used=self.block_pool.num_used_blocks,
            kv_blocks_total=self.block_pool.num_blocks,
            tokens_in_flight=sum(r.num_tokens for r in scheduler.running),
            prefix_cache_queried_tokens=kv.num_queried_tokens,
            prefix_cache_hit_tokens=kv.num_hit_tokens,
            kv_tier_hit_tokens=kv.num_tier_hit_tokens,
            num_preemptions=scheduler.num_preemptions,
            kv_shared_hit_tokens=kv.num_shared_hit_tokens,
            spec_proposed_tokens=speculation.num_proposed if speculation else 0,
            spec_accepted_tokens=speculation.num_accepted if speculation else 0,
            spec_verifications=speculation.num_verifications if speculation else 0,
            prefill_s_per_token=self.costs.prefill_s_per_token,
            tier_s_per_block=self.costs.tier_s_per_block(kv.tier),
            shared_tier_available=kv.tier.shared_available() if kv.tier is not None else True,
            tier_load_deadline_s=kv.tier.load_deadline_s if kv.tier is not None else 0.0,
            tier_load_extension_s_per_block=kv.tier.extension_s_per_block if kv.tier is not None else 0.0,
        )

    def kv_event_log(self) -> KVEventLog | None:
        """The `stored`/`removed` event log (thread-safe to read), or None when events are not recorded."""
        return self._events

    def kv_snapshot(self) -> KVSnapshot:
        """Call between steps (on the engine's thread), so keys and sequence number agree."""
        seq = self._events.last_seq if self._events is not None else 0  # first: events after it may repeat a key
        tier = self.kv_manager.tier
        local_keys, shared_store = (tier.local_keys(), tier.shared_store()) if tier is not None else ([], None)
        segments, blend = None, None
        if self.kv_manager.segments is not None:
            segments = self.block_pool.cached_fingerprints()
            settings = self.config.blend
            blend = BlendAdvert(self.config.non_prefix_reuse, settings.recompute_fraction, settings.min_reused_fraction)
        keys = self.block_pool.cached_block_keys()
        return KVSnapshot(seq, keys, self.namespace, local_keys, shared_store, segments, blend)

    # ----------------------------------------------------------------- transfers (prefill/decode disaggregation)

    def read_export(self, transfer_id: str, start: int, max_blocks: int = 64) -> ExportRead | None:
        """Blocks `start`, ... of a transfer in the block codec, from any thread (`exports.read_export`)."""
        return read_export(self.kv_exports, self.block_reader, transfer_id, start, max_blocks)

    def release_export(self, transfer_id: str) -> bool:
        """The decode side is done with a transfer (engine thread); False when it is unknown or expired."""
        return self.kv_exports.release(transfer_id)

    def attach_puller(self, puller: BlockPuller | None, block_on_loads: bool = True) -> None:
        """Let requests pull their prompts' blocks from prefill replicas (None: they compute them). An engine on
        an event loop passes `block_on_loads=False`: steps then never wait for a load to finish."""
        self.kv_manager.puller = puller if self.config.enable_prefix_caching else None
        if not block_on_loads:
            self.kv_manager.load_wait_s = 0.0

    def loads_pending(self) -> bool:
        """Some waiting request waits for blocks being loaded or pulled."""
        return any(request.tier_load is not None for request in self.scheduler.waiting)

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def attach_tier(self, tier: BlockTier | None) -> None:
        """Put a lower KV tier below the device cache (None detaches it); its events go to the replica's log."""
        self.kv_manager.tier = tier if self.config.enable_prefix_caching else None
        if self.kv_manager.tier is not None:
            self.kv_manager.tier.publish_events(self._events)


# What adopt_core_state moves: everything EngineCore.__init__ builds but the runner, the proposer, the block reader
# and what both cores were configured with.
_CORE_STATE = (
    "_events",
    "block_pool",
    "kv_manager",
    "scheduler",
    "kv_exports",
    "_requests",
    "_detokenizers",
    "_root_keys",
    "costs",
    "grammars",
)


def _output(request: Request, new_token_ids: list[int], text: str, new_text: str) -> RequestOutput:
    finished = request.is_finished
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=list(request.output_token_ids),
        text=text,
        finished=finished,
        finish_reason=request.status.value if finished else None,
        num_cached_tokens=max(0, request.num_cached_tokens),
        num_local_tier_tokens=request.num_local_tier_tokens,
        num_shared_tier_tokens=request.num_shared_tier_tokens,
        num_blended_tokens=request.num_blended_tokens,
        new_token_ids=new_token_ids,
        new_text=new_text,
        logprobs=request.output_logprobs if request.sampling_params.logprobs is not None else None,
        prompt_logprobs=request.prompt_logprobs if request.sampling_params.prompt_logprobs is not None else None,
        stop_reason=request.stop_reason,
        times=RequestTimes(request.arrival_time, request.first_token_time, time.monotonic() if finished else None),
    )

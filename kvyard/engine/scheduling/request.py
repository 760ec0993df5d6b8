"""A request as the engine tracks it: tokens, progress, blocks, and why it finished."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvyard.engine.blend.settings import BlendSettings
from kvyard.engine.pooling.params import PoolingParams
from kvyard.engine.sampling.bad_words import banned_by_bad_words
from kvyard.engine.sampling.logprobs import TokenLogprobs
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.sampling.structured_output import GrammarMatcher
from kvyard.kvcache.block_key import chain_block_keys
from kvyard.kvcache.pd_stream import TransferHandle


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class BlockSource(Protocol):
    """Where blocks the device cache lacks come from: the KV tier, or another replica (see kv_cache_manager)."""

    def install(self, block_ids: Sequence[int], blocks: Sequence[Any]) -> None:
        """Copy fetched blocks into the device cache at `block_ids`."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class TierLoad:
    """KV blocks of a waiting request being loaded, from block `first_block` on, from the lower tier or (for a
    request prefilled elsewhere) from another replica."""

    first_block: int
    future: Future[Sequence[Any]]
    source: BlockSource
    block_ids: list[int] | None = None  # blocks reserved for it, written by the source as they arrive


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """Prefill/decode disaggregation for one request (docs/contracts.md §6)."""

    export_id: str | None = None  # prefill side: keep the computed blocks under a lease for a decode replica
    pull_from: TransferHandle | None = None  # decode side: pull the prompt's blocks before computing it


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_root_key: bytes
    block_size: int
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first scheduling; -1 until then
    num_local_tier_tokens: int = 0  # of those, loaded from the replica's own lower tiers
    num_shared_tier_tokens: int = 0  # of those, loaded from the shared store
    num_preemptions: int = 0
    num_steps_passed_over: int = 0  # steps that computed other prompts while this one waited (shortest-first)
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of block_table entered into the prefix cache
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    stop_token_ids: frozenset[int] = frozenset()  # the request's stop ids plus EOS unless ignore_eos
    tier_load: TierLoad | None = None  # blocks being loaded from the lower tier before admission
    tier_checked: bool = False  # the lower tier was asked since the request last lost its blocks
    kv_transfer: KVTransferParams | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # this step's proposed tokens (speculative decoding)
    spec_acceptance: float = 0.5  # estimated chance that a proposed token is right (adaptive speculation)
    spec_idle_steps: int = 0  # steps since it last proposed, while speculation did not pay
    spec_probe_interval: int = 8  # idle steps before its next probe (speculative.PROBE_EVERY, doubling)
    grammar: GrammarMatcher | None = None  # where its output stands in the grammar it must match
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per prompt token; the first None
    pooling: PoolingParams | None = None  # a prompt-only request: an embedding or score instead of tokens
    bad_words_token_ids: list[tuple[int, ...]] = field(default_factory=list)  # its bad words, tokenized
    blend: BlendSettings | None = None  # it may reuse moved text's KV when its prefix breaks (kvyard.engine.blend)
    exact_until: int | None = None  # blended: its KV from this position on is approximate, never cached
    num_blended_tokens: int = 0  # prompt tokens whose KV came from moved text when it was last admitted

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self.update_block_keys()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def streams(self) -> bool:
        """A client waits on this request's next token: it has output (a preempted one recomputing its outputs
        too) or its whole prompt computed."""
        return bool(self.output_token_ids) or self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked and not all computed yet: its prompt cannot come from a cache."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position's output is wanted (prompt logprobs, mean pooling): none may come from a cache."""
        return self.needs_prompt_logprobs or (self.pooling is not None and self.pooling.reads_every_position)

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    def banned_token_ids(self, ahead: Sequence[int] = ()) -> frozenset[int]:
        """Tokens the sampler must not pick next (after `ahead`, proposed tokens being verified): the stop tokens
        until `min_tokens` are out, and those its bad words ban after the output."""
        banned = frozenset[int]()
        if self.num_output_tokens + len(ahead) < self.sampling_params.min_tokens:
            banned = self.stop_token_ids
        if self.bad_words_token_ids:
            banned |= banned_by_bad_words(self.bad_words_token_ids, self.output_token_ids, ahead)
        return banned

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self.update_block_keys()

    def update_block_keys(self) -> None:
        """Extend `block_keys` to cover every full block of `all_token_ids`."""
        start = len(self.block_keys) * self.block_size
        parent = self.block_keys[-1] if self.block_keys else self.cache_root_key
        self.block_keys.extend(chain_block_keys(parent, self.all_token_ids[start:], self.block_size))

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; every token (prompt and output so far) is recomputed."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_registered_blocks = 0
        self.num_preemptions += 1
        self.tier_checked = False
        self.exact_until = None
        self.num_blended_tokens = 0

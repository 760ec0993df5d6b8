"""Workloads: what to send. Every workload is a list of sessions; a session yields one request at a time.

Single-request workloads (random, shared-prefix, trace) have one-request sessions; a multi-turn session
builds each turn from the previous one. Prompts are token ids, drawn deterministically from the seed,
so the same parameters always send the same tokens.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvyard.bench.prefix import ideal_block_hit_ratio
from kvyard.bench.records import RequestRecord
from kvyard.bench.settings import LengthRange
from kvyard.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True, slots=True)
class TokenSource:
    """Deterministic token ids in [0, vocab_size) for a key: equal keys give equal tokens, and the first
    n tokens of a key do not depend on how many are asked for (so a cut block is a prefix of the whole).

    Token i of a key is splitmix64(key hash + i) mod vocab_size, computed vectorised: a few microseconds
    per prompt, where building a numpy Generator per prompt costs ~75 µs and limits the request rate.
    """

    vocab_size: int
    seed: int

    def tokens(self, key: Sequence[int], count: int) -> list[int]:
        base = _key_hash(self.seed, key)
        if count <= _SMALL:  # numpy's per-call overhead dominates short runs
            return [_splitmix64((base + i) & _MASK) % self.vocab_size for i in range(count)]
        with np.errstate(over="ignore"):
            z = np.arange(count, dtype=np.uint64) + np.uint64(base)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
            z ^= z >> np.uint64(31)
        ids: list[int] = (z % np.uint64(self.vocab_size)).tolist()
        return ids


_SMALL = 48
_MASK = (1 << 64) - 1
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


def _key_hash(seed: int, key: Sequence[int]) -> int:
    digest = hashlib.blake2b(repr((seed, *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int]
    max_tokens: int
    delay: float = 0.0  # think time: seconds to wait after the session's previous request finished


class Session(Protocol):
    arrival: float | None  # seconds after the start (trace timestamps); None lets the scheduler decide

    def next_request(self, previous: RequestRecord | None) -> RequestSpec | None: ...


@dataclass(slots=True)
class Workload:
    name: str
    sessions: list[Session]
    params: dict[str, Any]  # recorded verbatim in the result
    num_requests: int  # expected, for the progress bar
    info: dict[str, Any] = field(default_factory=dict)  # facts of the workload itself (a trace's ideal hit ratio)


# ---------------------------------------------------------------------------- single requests

_PROMPT, _PREFIX, _SUFFIX, _HISTORY, _REPLY, _REWRITE, _BLOCK = range(7)  # token-source key spaces


@dataclass(slots=True)
class SingleRequest:
    """A one-request session whose prompt is assembled only when it is sent (prompts can be large)."""

    arrival: float | None
    parts: tuple[tuple[tuple[int, ...], int], ...]  # (token key, length) pieces, concatenated
    max_tokens: int
    source: TokenSource
    sent: bool = False

    def next_request(self, previous: RequestRecord | None) -> RequestSpec | None:
        if self.sent:
            return None
        self.sent = True
        prompt = [token for key, length in self.parts for token in self.source.tokens(key, length)]
        return RequestSpec(prompt, self.max_tokens)


def random_workload(
    num_requests: int, input_len: LengthRange, output_len: LengthRange, source: TokenSource
) -> Workload:
    rng = random.Random(source.seed)
    sessions: list[Session] = [
        SingleRequest(None, (((_PROMPT, i), input_len.draw(rng)),), output_len.draw(rng), source)
        for i in range(num_requests)
    ]
    params = {"num_requests": num_requests, "input_len": str(input_len), "output_len": str(output_len)}
    return Workload("random", sessions, params, num_requests)


def shared_prefix_workload(
    num_requests: int,
    num_groups: int,
    prefix_len: int,
    input_len: LengthRange,
    output_len: LengthRange,
    source: TokenSource,
) -> Workload:
    """Request i belongs to group i mod num_groups: the groups' first requests come first, then reuse."""
    rng = random.Random(source.seed)
    sessions: list[Session] = []
    for i in range(num_requests):
        parts = (((_PREFIX, i % num_groups), prefix_len), ((_SUFFIX, i), input_len.draw(rng)))
        sessions.append(SingleRequest(None, parts, output_len.draw(rng), source))
    params = {
        "num_requests": num_requests,
        "num_groups": num_groups,
        "prefix_len": prefix_len,
        "input_len": str(input_len),
        "output_len": str(output_len),
    }
    return Workload("shared-prefix", sessions, params, num_requests)


# ---------------------------------------------------------------------------- multi-turn


@dataclass(frozen=True, slots=True)
class MultiturnShape:
    num_sessions: int
    turns: int
    system_len: int  # shared by every session (a coding assistant's system prompt and tool definitions)
    first_len: LengthRange  # the session's first user message (the task, files pasted in)
    turn_len: LengthRange  # new text each later turn (tool output, the next instruction)
    output_len: LengthRange
    think_time: float  # mean seconds between a reply and the next turn (exponential); 0 for none
    rewrite_prob: float  # chance that a turn rewrites the middle of the history first
    max_context: int | None  # history + answer limit; an over-long history is compacted (rewritten)


@dataclass(slots=True)
class MultiturnSession:
    """Each turn resends the whole history plus new tokens.

    The history is token ids, so what is resent is known exactly. The assistant's answer enters the
    history as client-chosen tokens of the length the server reported (no tokenizer is needed to turn
    the streamed text back into ids); a server that caches its generated blocks therefore hits on
    the previous prompt, not on the previous answer. A rewrite replaces the middle third of the
    conversation after the system prompt with a new span half as long, as a client compacting its
    context does, so the cached prefix ends where the rewrite begins.
    """

    index: int
    shape: MultiturnShape
    source: TokenSource
    rng: random.Random
    arrival: float | None = None
    history: list[int] = field(default_factory=list)
    turn: int = 0
    rewrites: int = 0

    def next_request(self, previous: RequestRecord | None) -> RequestSpec | None:
        shape = self.shape
        if self.turn >= shape.turns:
            return None
        if self.turn == 0:
            self.history = self.source.tokens((_PREFIX, 0), shape.system_len)
            new_tokens = shape.first_len.draw(self.rng)
        else:
            if previous is not None and previous.ok:
                self.history += self.source.tokens((_REPLY, self.index, self.turn), previous.output_tokens)
            new_tokens = shape.turn_len.draw(self.rng)
            if self.rng.random() < shape.rewrite_prob:
                self._rewrite_middle()
        max_tokens = shape.output_len.draw(self.rng)
        while shape.max_context and len(self.history) + new_tokens + max_tokens > shape.max_context:
            if not self._rewrite_middle():
                return None  # even compacted, the next turn does not fit: the session ends
        self.history += self.source.tokens((_HISTORY, self.index, self.turn), new_tokens)
        delay = 0.0 if self.turn == 0 or shape.think_time <= 0 else self.rng.expovariate(1 / shape.think_time)
        self.turn += 1
        return RequestSpec(list(self.history), max_tokens, delay)

    def _rewrite_middle(self) -> bool:
        body = len(self.history) - self.shape.system_len
        if body < 3:
            return False
        begin = self.shape.system_len + body // 3
        end = self.shape.system_len + 2 * body // 3
        summary = self.source.tokens((_REWRITE, self.index, self.turn, self.rewrites), (end - begin) // 2)
        self.history[begin:end] = summary
        self.rewrites += 1
        return True


def multiturn_workload(shape: MultiturnShape, source: TokenSource) -> Workload:
    sessions: list[Session] = [
        MultiturnSession(i, shape, source, random.Random(f"{source.seed}:{i}")) for i in range(shape.num_sessions)
    ]
    params = {
        "num_sessions": shape.num_sessions,
        "turns": shape.turns,
        "system_len": shape.system_len,
        "first_len": str(shape.first_len),
        "turn_len": str(shape.turn_len),
        "output_len": str(shape.output_len),
        "think_time_s": shape.think_time,
        "rewrite_prob": shape.rewrite_prob,
        "max_context": shape.max_context,
    }
    return Workload("multiturn", sessions, params, shape.num_sessions * shape.turns)


def count_rewrites(workload: Workload) -> int:
    return sum(s.rewrites for s in workload.sessions if isinstance(s, MultiturnSession))


# ---------------------------------------------------------------------------- trace replay


@dataclass(frozen=True, slots=True)
class TraceScaling:
    time_scale: float = 1.0  # arrival = timestamp * time_scale (0.1 replays ten times faster)
    length_scale: float = 1.0  # input lengths; a 512-token hash block becomes round(512 * scale) tokens
    output_scale: float = 1.0
    max_input_len: int | None = None  # after scaling; longer prompts keep their leading blocks
    max_output_len: int | None = None


def trace_workload(trace: list[TraceRequest], scaling: TraceScaling, source: TokenSource, name: str) -> Workload:
    """Replay `trace`. Each hash id becomes a deterministic block of token ids, so equal ids give equal
    prefixes; requests without hash ids (Azure) get tokens of their own."""
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scaling.length_scale))
    sessions: list[Session] = []
    replayed_blocks: list[tuple[int, ...]] = []
    full_blocks: list[tuple[int, ...]] = []
    for i, request in enumerate(trace):
        input_len = max(1, round(request.input_length * scaling.length_scale))
        if scaling.max_input_len is not None:
            input_len = min(input_len, scaling.max_input_len)
        output_len = max(1, round(request.output_length * scaling.output_scale))
        if scaling.max_output_len is not None:
            output_len = min(output_len, scaling.max_output_len)
        if request.hash_ids is None:
            parts: tuple[tuple[tuple[int, ...], int], ...] = (((_PROMPT, i), input_len),)
        else:
            input_len = min(input_len, block * len(request.hash_ids))
            kept = request.hash_ids[: math.ceil(input_len / block)]
            replayed_blocks.append(kept)
            full_blocks.append(request.hash_ids)
            parts = _block_parts(kept, block, input_len)
        sessions.append(SingleRequest(request.timestamp * scaling.time_scale, parts, output_len, source))
    params = {
        "trace": name,
        "num_requests": len(trace),
        "time_scale": scaling.time_scale,
        "length_scale": scaling.length_scale,
        "output_scale": scaling.output_scale,
        "block_tokens": block,
        "max_input_len": scaling.max_input_len,
        "max_output_len": scaling.max_output_len,
    }
    info: dict[str, Any] = {"trace_duration_s": trace[-1].timestamp if trace else 0.0}
    if replayed_blocks:
        # Of the blocks replayed (after --max-input-len), and of the same requests at their full length.
        info["trace_ideal_block_hit_ratio"] = ideal_block_hit_ratio(replayed_blocks)
        info["trace_ideal_block_hit_ratio_unscaled"] = ideal_block_hit_ratio(full_blocks)
    return Workload("trace", sessions, params, len(trace), info)


def _block_parts(hash_ids: Sequence[int], block: int, input_len: int) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Whole blocks for every id but the last, which is cut to make exactly `input_len` tokens."""
    last = input_len - block * (len(hash_ids) - 1)
    return tuple(((_BLOCK, h), block if i < len(hash_ids) - 1 else last) for i, h in enumerate(hash_ids))

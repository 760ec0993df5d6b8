"""`kvyard bench`'s settings, from which its options are generated (kvyard/cli/bench.py).

A module of its own, light: the command line reads it without the load client or numpy. The groups of
`kvyard bench --help` are its classes: the server, the load, then each workload's own settings.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.bench.metrics import SLO, parse_slo
from kvyard.settings import setting

WORKLOADS = ("random", "shared-prefix", "multiturn", "trace")
DEFAULT_NUM_REQUESTS = 100  # of the workloads that are not a trace


@dataclass(frozen=True, slots=True)
class LengthRange:
    """A fixed length (`low == high`) or a uniform integer range."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """`1024` or `128:512`."""
        low_text, _, high_text = text.partition(":")
        try:
            low, high = int(low_text), int(high_text or low_text)
        except ValueError as error:
            raise ValueError(f"expected a length like 1024 or 128:512, got {text!r}") from error
        if not 1 <= low <= high:
            raise ValueError(f"lengths must satisfy 1 <= low <= high, got {text!r}")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class EndpointSettings:
    """Server: the endpoint and what every request asks of it."""

    base_url: str = setting(help="e.g. http://127.0.0.1:8000 (without /v1)")
    model: str | None = setting(None, help="model id", default_text="the first of /v1/models")
    api_key: str | None = setting(None, help="sent as `Authorization: Bearer KEY`", secret=True)
    timeout: float = setting(600.0, help="seconds per request")
    ignore_eos: bool = setting(True, help="send ignore_eos (--no-ignore-eos: output lengths are then up to the model)")
    temperature: float = setting(0.0, help="sampling temperature of every request")
    vocab_size: int = setting(1000, help="prompt token ids are drawn from [0, N); 1000 fits every kvyard preset")

    def __post_init__(self) -> None:
        _check_at_least_one({"--vocab-size": self.vocab_size})


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """Load: what to send, how much and how fast."""

    workload: str = setting("random", choices=WORKLOADS, help="what to send (options per workload below)")
    num_requests: int | None = setting(
        None,
        help="requests (trace: a limit)",
        default_text=f"random, shared-prefix: {DEFAULT_NUM_REQUESTS}; trace: all",
    )
    concurrency: int | None = setting(
        None,
        help="closed loop: requests in flight; with --request-rate, a cap",
        default_text="1; none with --request-rate or the trace workload",
    )
    request_rate: float | None = setting(None, help="open loop: Poisson arrivals per second")
    input_len: LengthRange = setting(
        LengthRange(1024, 1024),
        parse=LengthRange.parse,
        help="prompt tokens: N or LOW:HIGH (shared-prefix: after the prefix)",
    )
    output_len: LengthRange = setting(
        LengthRange(128, 128), parse=LengthRange.parse, help="output tokens: N or LOW:HIGH"
    )
    seed: int = setting(0, help="seed of the workload's random choices")
    slo: SLO | None = setting(None, parse=parse_slo, help="goodput objectives, e.g. ttft=500ms,tpot=50ms")

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        _check_at_least_one({"--num-requests": self.num_requests, "--concurrency": self.concurrency})
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"--request-rate must be positive, got {self.request_rate}")

    def concurrency_limit(self) -> int | None:
        """--concurrency; unset, one request at a time, unless arrivals are open (a request rate, a trace's
        timestamps): those need no bound."""
        if self.concurrency is not None or self.request_rate is not None or self.workload == "trace":
            return self.concurrency
        return 1


@dataclass(frozen=True, slots=True)
class SharedPrefixSettings:
    """Shared-prefix: with --workload shared-prefix."""

    num_groups: int = setting(4, help="groups of requests sharing a prefix")
    prefix_len: int = setting(1024, help="tokens of each shared prefix")

    def __post_init__(self) -> None:
        _check_at_least_one({"--num-groups": self.num_groups})


@dataclass(frozen=True, slots=True)
class MultiturnSettings:
    """Multiturn: with --workload multiturn."""

    num_sessions: int = setting(8, help="concurrent conversations")
    turns: int = setting(5, help="turns per conversation")
    system_len: int = setting(1024, help="system prompt shared by every session")
    first_len: LengthRange = setting(
        LengthRange(512, 512), parse=LengthRange.parse, help="tokens of each session's first message"
    )
    turn_len: LengthRange = setting(
        LengthRange(128, 128), parse=LengthRange.parse, help="new tokens in every later turn"
    )
    think_time: float = setting(0.0, help="mean seconds between turns (exponential)")
    rewrite_prob: float = setting(0.0, help="chance that a turn rewrites the middle of the history first")
    max_context: int | None = setting(
        None, help="compact histories beyond this", default_text="the server's max_model_len"
    )

    def __post_init__(self) -> None:
        _check_at_least_one({"--num-sessions": self.num_sessions, "--turns": self.turns})
        if not 0 <= self.rewrite_prob <= 1:
            raise ValueError(f"--rewrite-prob must be in [0, 1], got {self.rewrite_prob}")


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """Trace: with --workload trace."""

    trace: str = setting(
        "mooncake", help="mooncake, azure (public traces kvyard ships) or a .jsonl/.csv path (.gz too)"
    )
    time_scale: float = setting(1.0, help="arrival times are multiplied by this")
    length_scale: float = setting(1.0, help="input lengths are multiplied by this")
    output_scale: float = setting(1.0, help="output lengths are multiplied by this")
    max_input_len: int | None = setting(None, help="cap on scaled prompts (keeps the prefix)")
    max_output_len: int | None = setting(None, help="cap on scaled outputs")

    def __post_init__(self) -> None:
        scales = (
            ("--time-scale", self.time_scale),
            ("--length-scale", self.length_scale),
            ("--output-scale", self.output_scale),
        )
        for flag, scale in scales:
            if scale <= 0:
                raise ValueError(f"{flag} must be positive")


@dataclass(frozen=True, slots=True)
class OutputSettings:
    """Output: the result, its plot and what the run shows meanwhile."""

    out: Path | None = setting(None, help="result JSON")
    plot: Path | None = setting(None, help="PNG: TTFT/ITL CDFs and TTFT over time")
    ideal_block_size: int = setting(16, help="block size for the ideal prefix hit ratio (match the server's)")
    progress: bool = setting(True, help="a progress bar on stderr")

    def __post_init__(self) -> None:
        _check_at_least_one({"--ideal-block-size": self.ideal_block_size})


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """One `kvyard bench` run. Only the settings of its --workload are used of the workloads' own."""

    server: EndpointSettings
    load: LoadSettings = field(default_factory=LoadSettings)
    shared_prefix: SharedPrefixSettings = field(default_factory=SharedPrefixSettings)
    multiturn: MultiturnSettings = field(default_factory=MultiturnSettings)
    replay: TraceSettings = field(default_factory=TraceSettings)  # not `trace`: that is a setting's name
    output: OutputSettings = field(default_factory=OutputSettings)


def _check_at_least_one(values: Mapping[str, int | None]) -> None:
    for flag, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")

"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.engine.sampling.structured_output import StructuredOutput
from kvyard.settings import setting


@dataclass(slots=True)
class SamplingParams:
    """Sampling: how each request chooses and stops."""

    max_tokens: int = setting(16, help="tokens to generate at most")
    temperature: float = setting(1.0, help="0 is greedy; higher is more random")
    top_p: float = setting(1.0, help="sample from the smallest set of tokens whose probability reaches this")
    top_k: int = setting(0, help="sample from the k most likely tokens; 0 or -1: all")
    min_p: float = setting(0.0, help="drop tokens less likely than this times the most likely one; 0 is off")
    seed: int | None = setting(None, help="seed of this request's sampling, for repeatable output")
    stop: list[str] = setting(default_factory=list, help="stop at this string (repeatable)")
    stop_token_ids: list[int] = setting(default_factory=list, help="stop at this token id (repeatable)")
    ignore_eos: bool = setting(False, help="keep generating past the end-of-sequence token")
    include_stop_str_in_output: bool = setting(False, help="keep the matched stop string in the text")
    skip_special_tokens: bool = setting(
        True, help="leave special tokens (end-of-turn markers and the like) out of the output text"
    )
    logprobs: int | None = setting(
        None, help="return the log-probability of each sampled token and of this many top alternatives (0-20)"
    )
    prompt_logprobs: int | None = setting(
        None,
        help="return the log-probability of each prompt token (after "
        "the first) and of this many top alternatives (0-20); the prompt is "
        "then computed whole, not taken from the prefix cache",
    )
    min_tokens: int = setting(0, help="tokens to generate before EOS or a stop token may end the output")
    presence_penalty: float = setting(
        0.0, help="subtract this from the logit of every token already in the output (-2 to 2)"
    )
    frequency_penalty: float = setting(
        0.0, help="subtract this times its count in the output from each token's logit (-2 to 2)"
    )
    repetition_penalty: float = setting(
        1.0, help="divide positive (multiply negative) logits of tokens in the prompt or output by this; 1 is off"
    )
    # token id -> bias (-100 to 100) added to its logit; a JSONL record's or API body's string keys are ids too
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words: list[str] = setting(
        default_factory=list,
        help="a word never to generate (repeatable): the last of "
        "its tokens, with and without a leading space, is banned wherever the output "
        "ends with the ones before it (vLLM's bad_words)",
    )
    structured: StructuredOutput | None = None  # what the output must match (constrained decoding)
    speculate: bool = setting(
        True, help="let speculative decoding propose tokens for this request, when the engine has it on (--speculative)"
    )
    non_prefix_reuse: str | None = None  # off or blend: what it may reuse beyond a cached prefix (None: the engine's)
    priority: int = 0  # lower is served first, under the engine's scheduling_policy "priority" (else it must be 0)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = {_token_id(key): float(value) for key, value in self.logit_bias.items()}
        self._check_ranges()

    def _check_ranges(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens, got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not all(isinstance(word, str) for word in self.bad_words):
            raise ValueError(f"bad_words must be strings, got {self.bad_words!r}")
        if self.non_prefix_reuse not in (None, "off", "blend"):
            raise ValueError(f"non_prefix_reuse must be off or blend, got {self.non_prefix_reuse!r}")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2**16:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias} for token {token_id}")

    @property
    def has_penalties(self) -> bool:
        """Whether a token's logit depends on the tokens before it (repetition, frequency, presence)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _token_id(key: object) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")

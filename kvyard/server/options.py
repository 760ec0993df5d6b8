"""Settings of the HTTP side of a replica (a module of its own: the command line reads it without the server)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvyard.api.auth import AccessConfig
from kvyard.net.http_server import HttpServerConfig
from kvyard.server.reasoning import REASONING_PARSERS
from kvyard.settings import setting

ROLES = ("unified", "prefill", "decode")
POOLING_CHOICES = ("auto", "last", "mean")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Server: the HTTP side of a replica."""

    max_queued_seqs: int = setting(
        512, help="sequences (prompts × n) accepted beyond --max-num-seqs before answering 429"
    )

    role: str = setting(
        "unified",
        choices=ROLES,
        help="what the router sends here: whole requests (unified), "
        "prefills whose decode runs elsewhere (prefill), or decodes of prompts prefilled elsewhere "
        "(decode); every role still serves any request",
    )
    reject_unknown_fields: bool = setting(
        False,
        help="answer 400 to a request field kvyard does not know (by "
        "default such fields are ignored with a logged warning and an "
        "X-Kvyard-Ignored-Fields header, as vLLM ignores them)",
    )
    tool_call_parser: str = setting(
        "auto",
        choices=TOOL_CALL_PARSERS,
        help="how tool calls are read from the "
        "model's text under tool_choice auto: <tool_call> JSON tags (hermes: Hermes, "
        "Qwen), a bare JSON object (llama3_json), or the one the chat template "
        "writes (auto)",
    )
    reasoning_parser: str | None = setting(
        None,
        choices=REASONING_PARSERS,
        help="a reasoning model's thinking "
        "goes in reasoning_content, not content: qwen3 (an answer that opens "
        "<think>), deepseek_r1 (the template opens it)",
        default_text="none: thinking stays in content",
    )
    fast_start: bool = setting(
        True,
        help="serve a weight package or fp32 checkpoint from the native CPU kernels "
        "while PyTorch loads, then hand over to the PyTorch engine (kvyard.engine.fast_start.engine); "
        "configurations it cannot run start as without it",
    )
    shutdown_grace_s: float = setting(60.0, help="on SIGTERM, how long requests in flight may take to finish")
    pooling: str = setting(
        "auto",
        choices=POOLING_CHOICES,
        help="how /v1/embeddings pools the final hidden states: the last token's (decoder embedding models such as "
        "Qwen3-Embedding), their mean, or auto (the model directory's sentence-transformers pooling config, else last)",
    )
    score_tokens: str = setting(
        "no,yes",
        help="the answer tokens of /v1/rerank and /score, as NO,YES: a score is the probability of YES against NO "
        "after the judging prompt (yes/no rerankers such as Qwen3-Reranker)",
    )
    owned_by: str = "kvyard"
    access: AccessConfig = field(default_factory=AccessConfig)  # admin plane here: /kv/* and fault injection
    http: HttpServerConfig = field(default_factory=HttpServerConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_CHOICES)}, got {self.pooling!r}")
        if len([word for word in self.score_tokens.split(",") if word]) != 2:
            raise ValueError(f"score_tokens must be two words separated by a comma (no,yes), got {self.score_tokens!r}")
        if self.max_queued_seqs < 0:
            raise ValueError(f"max_queued_seqs must be >= 0, got {self.max_queued_seqs}")

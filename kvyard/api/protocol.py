"""Request bodies of the OpenAI-compatible API, validated field by field, and how a raw body becomes one.

Validation is strict: a string is not a number, a boolean is not an integer, so `[0, 1, "2"]` is not a
list of token ids; every number has the range the engine can take (a seed fits a 64-bit generator).
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvyard.api.errors import APIError, bad_request

MAX_N = 16
MAX_PROMPTS = 256  # prompts in one completions request
MAX_SEED = 2**63 - 1 - MAX_N  # choice i of n samples with seed + i, a signed 64-bit generator seed
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default --max-logprobs
MAX_BAD_WORDS = 128
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
Model = TypeVar("Model", bound=BaseModel)
IGNORED_FIELDS_HEADER = "X-Kvyard-Ignored-Fields"  # names the request fields a replica ignored (drop_unknown)
_GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's guided_json, ... (structured_outputs' members)
_FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise bad_request(f"request body is not valid JSON: {error}", "body") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "body")
    return body


def validate(body: dict[str, Any], model: type[Model]) -> Model:
    """`body` as `model`, or a 400 naming the first bad field (an unknown one included: see `drop_unknown`)."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from None


def drop_unknown(body: dict[str, Any], model: type[BaseModel]) -> list[str]:
    """Takes the top-level fields `model` does not know out of `body`; their names, sorted. vLLM ignores such
    fields (OpenAI's `metadata`, `store`, another engine's options), so clients send them; the known ones stay
    strictly typed."""
    unknown = sorted(name for name in body if name not in model.model_fields)
    for name in unknown:
        del body[name]
    return unknown


def header_safe_names(names: list[str], limit: int = 16) -> str:
    """Client-chosen field names as one header value: names of word characters, dots and dashes only (no line
    breaks reach a header), at most `limit` of them."""
    kept = [name for name in names if _FIELD_NAME.fullmatch(name)][:limit]
    return ", ".join(kept) + (", ..." if len(kept) < len(names) else "")


def validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    param = _param_name(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {param}", param, "extra_forbidden")
    if param == "input":  # the embeddings' union, as the prompt's
        return APIError(
            400,
            "input must be a string, a list of strings, a list of token ids (integers) or a list of lists of token ids",
            param,
            first.get("type"),
        )
    if param == "prompt":  # a union: pydantic names only its first member's complaint
        return APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids (integers) or a list "
            "of lists of token ids",
            param,
            first.get("type"),
        )
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param, first.get("type"))


def _param_name(location: Any) -> str | None:
    """`messages.0.role` from pydantic's location, without the union-member tags it adds (`prompt.str`)."""
    parts = []
    for part in location:
        text = str(part)
        if text in _UNION_TAGS or "[" in text or text.startswith("function-"):
            continue
        parts.append(text)
    return ".".join(parts) or None


def take_token_ids(body: dict[str, Any]) -> list[int] | None:
    """A long token-id `prompt`, taken out of `body` so that validating the rest stays cheap (pydantic checks
    a list of ints element by element); the caller checks the ids against the vocabulary instead."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and set(map(type, prompt)) == {int}:
        body["prompt"] = prompt[:1]
        return prompt
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResumeState(BaseModel):
    """Where a stream that another replica began stands: the tokens it generated and the characters of their text
    the client already has. The router sends it to continue a stream whose replica failed (kvyard extension)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    token_ids: list[int]  # empty when only a chat's role chunk went out
    sent_chars: int = Field(ge=0)
    id: str | None = Field(default=None, max_length=128)  # the stream's id and creation time, kept
    created: int | None = Field(default=None, ge=0, le=2**40)


class KVTransferFields(BaseModel):
    """Prefill/decode disaggregation (kvyard extension; docs/contracts.md §6). The router sends the same request
    to a prefill replica with `do_remote_decode` and to a decode replica with `do_remote_prefill`, the prefill
    replica's URL as `source`, and one fresh `transfer_id`. Honoured only from a caller with the admin key."""

    model_config = ConfigDict(extra="forbid", strict=True)
    do_remote_decode: bool = False  # prefill here, keep the blocks under a lease for a decode replica
    do_remote_prefill: bool = False  # pull the prompt's blocks from `source` instead of computing them
    transfer_id: str = Field(pattern=r"^[A-Za-z0-9_.-]{8,128}$")
    transfer_token: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{16,128}$")  # both legs: one secret
    source: str | None = Field(default=None, pattern=r"^https?://[^\s/?#]+/?$", max_length=512)

    @model_validator(mode="after")
    def _one_role(self) -> KVTransferFields:
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("set exactly one of do_remote_decode and do_remote_prefill")
        if self.do_remote_prefill and self.source is None:
            raise ValueError("do_remote_prefill needs the prefill replica's URL as source")
        if self.do_remote_decode and self.source is not None:
            raise ValueError("source goes with do_remote_prefill only")
        return self


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # always enforced: the output matches the schema whatever this says


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and that type needs it")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (kvyard accepts the same): exactly one constraint on the output."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, max_length=16384)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = Field(default=None, max_length=65536)  # Lark syntax
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self


class SamplingFields(BaseModel):
    """Parameters shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    include_stop_str_in_output: bool = False
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    # kvyard extensions for the router's failover: progress lines in a stream, and resuming one
    stream_progress: bool = False
    resume: ResumeState | None = None
    kv_transfer_params: KVTransferFields | None = None
    speculate: bool = True  # false: no speculative decoding for this request (when the replica has it on)
    non_prefix_reuse: Literal["off", "blend"] | None = None  # reuse beyond a cached prefix (None: --non-prefix-reuse)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0**16)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's earlier names for structured_outputs' members, still sent by clients (LiteLLM, older SDK code)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, max_length=16384)
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(default=None, max_length=65536)
    # vLLM's sampling and scheduling extensions
    skip_special_tokens: bool = True
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=2**63 - 1)  # -1: as many as fit
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)  # lower is served first (--scheduling-policy)

    @model_validator(mode="before")
    @classmethod
    def _guided_fields_as_structured_outputs(cls, data: Any) -> Any:
        """guided_* fields become the structured_outputs they name (unless that is given too: see unsupported)."""
        if not isinstance(data, dict) or data.get("structured_outputs") is not None:
            return data
        guided = {name: data[f"guided_{name}"] for name in _GUIDED if data.get(f"guided_{name}") is not None}
        if not guided:
            return data
        rest = {key: value for key, value in data.items() if not key.startswith("guided_")}
        return {**rest, "structured_outputs": guided}

    @field_validator("logit_bias")
    @classmethod
    def _token_id_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be between -100 and 100, got {bias} for token {key}")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keeps_some_tokens(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError(
                "must be -1 (as many tokens as the context leaves room for) or a positive number of tokens to keep"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings are supported")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) for a parameter kvyard accepts syntactically but does not implement."""
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            return "structured_outputs", "give response_format or structured_outputs, not both"
        for name in _GUIDED:
            if getattr(self, f"guided_{name}") is not None:
                return f"guided_{name}", "give structured_outputs or the guided_* fields, not both"
        if self.resume is not None and self.n != 1:
            return "resume", "resume continues one choice: n must be 1"
        if self.kv_transfer_params is not None and self.kv_transfer_params.do_remote_decode and self.n != 1:
            return "kv_transfer_params", "a prefill for another replica runs one choice: n must be 1"
        if self.stream and self.prompt_logprobs:
            return "prompt_logprobs", "prompt_logprobs are not available when stream is true"
        return None

    @property
    def returned_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, where they are returned: a stream has none (as vLLM, only 0 may be asked there)."""
        return None if self.stream else self.prompt_logprobs


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of must equal n"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # a JSON object, serialised, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made, sent back in the history."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # on an assistant turn
    tool_call_id: str | None = None  # on a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content parts of type {kind[:40]!r} are not supported: the served models take "
                    "text only (no images, audio or files)"
                )
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # calls through tool_choice required or named always match `parameters`


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is continued: no generation prompt, no end of turn
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        asked_prompt = self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set
        if self.continue_final_message and asked_prompt:
            return "continue_final_message", "continue_final_message and add_generation_prompt cannot both be true"
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            return "tools", "tools must have distinct function names"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs=true"
        return super().unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def adds_generation_prompt(self) -> bool:
        """Whether the template opens a new assistant turn: not when the last message is continued."""
        return self.add_generation_prompt and not self.continue_final_message


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | list[int] | None = None  # token ids come back as they are (checked against the vocabulary)
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered with the messages, as a chat request with them would be
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

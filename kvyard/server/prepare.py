"""From a validated request body to what the engine runs: token prompts, sampling parameters, a cache salt."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvyard.api.checks import ContextLimits, check_sampling_token_ids, check_token_ids, resolve_max_tokens
from kvyard.api.errors import APIError, bad_request
from kvyard.api.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    KVTransferFields,
    ResumeState,
    SamplingFields,
)
from kvyard.engine.sampling.bad_words import bad_words_token_ids
from kvyard.engine.sampling.params import SamplingParams
from kvyard.engine.sampling.structured_output import StructuredOutput, checked_grammar
from kvyard.engine.scheduling.request import KVTransferParams
from kvyard.kvcache.pd_stream import TransferHandle
from kvyard.server.backend import ReplicaEngine, Vocabulary
from kvyard.server.reasoning import ReasoningParser
from kvyard.server.tool_calls import ToolPlan, parser_for, plan_tools, tools_for_template


@dataclass(slots=True)
class PreparedRequest:
    """A validated API request: token prompts and one SamplingParams per choice."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice within a prompt (n entries)
    cache_salt: str | None
    stream: bool
    include_usage: bool
    logprobs: int | None
    continuous_usage: bool = False  # usage so far on every streamed chunk (vLLM's continuous_usage_stats)
    stream_progress: bool = False  # each chunk after an SSE comment with its token ids (see completions)
    resume: ResumeState | None = None  # continue a stream another replica began
    kv_transfer: KVTransferParams | None = None  # prefill for, or pull the prompt's KV from, another replica
    tools: ToolPlan | None = None  # how a chat's output becomes tool calls
    reasoning: ReasoningParser | None = None  # how a chat's thinking is taken out of its content
    echo_texts: list[str] | None = None  # echo: each prompt's text, returned before its completion
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top alternatives of each prompt token returned
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * len(self.params)

    @property
    def num_tokens_asked(self) -> int:
        """Prompt plus max_tokens over every choice: what rate limits by tokens count."""
        return sum(len(prompt) + params.max_tokens for prompt in self.prompts for params in self.params)

    @property
    def stop_holdback(self) -> int:
        """Characters a stream holds back so that a client never sees text a later stop match removes."""
        return max((len(s) for s in self.params[0].stop), default=1) - 1


def prepare_completion(
    engine: ReplicaEngine, body: CompletionRequest, token_ids: list[int] | None, cache_salt: str | None
) -> PreparedRequest:
    """`token_ids`: the prompt when it was taken out of `body` before validation (see `take_token_ids`);
    `cache_salt`: the salt the request runs under (its tenant's and its own, `api.auth.tenant_salt`)."""
    check_model(engine, body.model)
    _reject_unsupported(body.unsupported())
    prompts = [token_ids] if token_ids is not None else _prompt_list(body.prompt)
    tokens = [_tokens_of(engine, prompt, index, len(prompts)) for index, prompt in enumerate(prompts)]
    if body.resume is not None and len(tokens) != 1:
        raise bad_request("resume continues one choice: send one prompt", "resume")
    if body.kv_transfer_params is not None and len(tokens) != 1:
        raise bad_request("a disaggregated request has one prompt", "kv_transfer_params")
    kept = truncated(tokens, body.truncate_prompt_tokens, body.max_tokens, engine.limits)
    prepared = _prepared("completion", engine, body, kept, body.max_tokens, body.logprobs, cache_salt)
    if body.echo:
        if body.resume is not None:
            raise bad_request("an echoed stream cannot be resumed", "resume")
        prepared.echo_texts = [
            p if isinstance(p, str) and len(k) == len(t) else _decoded(engine, k)
            for p, t, k in zip(prompts, tokens, kept)
        ]
        for params in prepared.params:
            if body.logprobs is not None:  # the echoed prompt's logprobs, and prompt_logprobs' if more were asked
                params.prompt_logprobs = max(body.logprobs, params.prompt_logprobs or 0)
    return prepared


def truncated(
    prompts: list[list[int]], keep: int | None, max_tokens: int | None, limits: ContextLimits
) -> list[list[int]]:
    """vLLM's `truncate_prompt_tokens`: the last `keep` tokens of each prompt; -1 keeps as many as leave room in
    the context for `max_tokens` (or for one token when it is not given)."""
    if keep is None:
        return prompts
    room = limits.max_model_len - (max_tokens or 1)
    if keep > room or room < 1:
        wanted = f"max_tokens={max_tokens}" if max_tokens is not None else "one generated token"
        raise bad_request(
            f"truncate_prompt_tokens={keep} leaves no room for {wanted} in the model's context of "
            f"{limits.max_model_len} tokens",
            "truncate_prompt_tokens",
        )
    keep = room if keep == -1 else keep
    return [prompt[-keep:] for prompt in prompts]


def _decoded(engine: ReplicaEngine, token_ids: list[int]) -> str:
    return engine.vocabulary.decode(token_ids) if engine.vocabulary is not None else ""


def prepare_chat(
    engine: ReplicaEngine,
    body: ChatCompletionRequest,
    cache_salt: str | None,
    tool_call_parser: str = "auto",
    reasoning: ReasoningParser | None = None,
) -> PreparedRequest:
    check_model(engine, body.model)
    _reject_unsupported(body.unsupported())
    vocabulary = vocabulary_of(engine, "messages")
    tool_plan, tool_constraint = plan_tools(body, parser_for(tool_call_parser, vocabulary.chat_template))
    if tool_plan is not None and body.resume is not None:
        raise bad_request("a stream with tools cannot be resumed", "resume")
    if reasoning is not None and body.resume is not None:
        raise bad_request("a stream whose reasoning is parsed cannot be resumed", "resume")
    template_kwargs = body.chat_template_kwargs
    if body.continue_final_message:
        template_kwargs = {**(template_kwargs or {}), "continue_final_message": True}
    rendered = render_chat(
        engine, body.messages, body.adds_generation_prompt, template_kwargs, tools_for_template(body)
    )
    prompts = truncated([rendered], body.truncate_prompt_tokens, body.requested_max_tokens, engine.limits)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # As vLLM: a required or named tool call's schema replaces response_format and structured_outputs; under
    # tool_choice auto they constrain the answer, from which calls are then read as usual.
    prepared = _prepared(
        "chat", engine, body, prompts, body.requested_max_tokens, logprobs, cache_salt, tool_constraint
    )
    prepared.tools = tool_plan
    prepared.reasoning = reasoning
    return prepared


def _prepared(
    kind: str,
    engine: ReplicaEngine,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    cache_salt: str | None,
    structured: StructuredOutput | None = None,
) -> PreparedRequest:
    max_tokens = resolve_max_tokens(max(len(p) for p in prompts), max_tokens, engine.limits)
    biased_ids = [int(key) for key in body.logit_bias or {}]
    check_sampling_token_ids(body.stop_token_ids or [], biased_ids, engine.limits.vocab_size)
    check_priority(engine, body.priority)
    if body.bad_words:  # the engine tokenizes them too: here a bad word is a 400 before any stream starts
        bad_words_token_ids(body.bad_words, vocabulary_of(engine, "bad_words"), engine.limits.vocab_size)
    structured = structured or structured_output_of(body)
    if structured is not None:
        vocabulary_of(engine, structured.param)
        checked_grammar(structured)  # a bad schema is a 400 before any stream starts
    resume = body.resume  # a continued stream keeps its identity
    prepared = PreparedRequest(
        kind=kind,
        request_id=(resume.id if resume is not None else None) or new_request_id(kind),
        model=engine.model_name,
        prompts=prompts,
        params=build_sampling_params(body, max_tokens, logprobs, structured),
        cache_salt=cache_salt,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage) or not body.stream,
        continuous_usage=bool(body.stream and body.stream_options and body.stream_options.continuous_usage_stats),
        logprobs=logprobs,
        stream_progress=body.stream_progress,
        resume=resume,
        kv_transfer=kv_transfer_params(body.kv_transfer_params),
        prompt_logprobs=body.returned_prompt_logprobs,
    )
    if resume is not None and resume.created is not None:
        prepared.created = resume.created
    return prepared


def kv_transfer_params(fields: KVTransferFields | None) -> KVTransferParams | None:
    if fields is None:
        return None
    if fields.do_remote_decode:
        return KVTransferParams(export_id=fields.transfer_id)
    assert fields.source is not None  # the model's validator requires it
    return KVTransferParams(
        pull_from=TransferHandle(fields.source.rstrip("/"), fields.transfer_id, fields.transfer_token)
    )


def structured_output_of(body: SamplingFields) -> StructuredOutput | None:
    """What the request's `response_format` or `structured_outputs` asks the output to match, if anything."""
    response_format = body.response_format
    if response_format is not None and response_format.json_schema is not None:
        return StructuredOutput.json_schema(response_format.json_schema.json_schema)
    if response_format is not None and response_format.type == "json_object":
        return StructuredOutput("json_object")
    wanted = body.structured_outputs
    if wanted is None:
        return None
    param = "structured_outputs"
    if wanted.json_ is not None:
        return StructuredOutput.json_schema(wanted.json_, param)
    if wanted.regex is not None:
        return StructuredOutput("regex", wanted.regex, param)
    if wanted.choice is not None:
        return StructuredOutput.choice(wanted.choice, param)
    if wanted.grammar is not None:
        return StructuredOutput("grammar", wanted.grammar, param)
    return StructuredOutput("json_object", "", param)


def build_sampling_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, structured: StructuredOutput | None = None
) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so the n choices differ."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    result = []
    for choice in range(body.n):
        try:
            result.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=body.top_k,
                    seed=None if body.seed is None else body.seed + choice,
                    stop=stops,
                    stop_token_ids=list(body.stop_token_ids or []),
                    ignore_eos=body.ignore_eos,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    skip_special_tokens=body.skip_special_tokens,
                    logprobs=logprobs,
                    prompt_logprobs=body.returned_prompt_logprobs,
                    min_tokens=min(body.min_tokens, max_tokens),
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    min_p=body.min_p,
                    logit_bias={int(key): bias for key, bias in (body.logit_bias or {}).items()},
                    bad_words=list(body.bad_words),
                    speculate=body.speculate,
                    non_prefix_reuse=body.non_prefix_reuse,
                    structured=structured,
                    priority=body.priority,
                )
            )
        except ValueError as error:
            raise bad_request(str(error)) from error
    return result


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def check_model(engine: ReplicaEngine, model: str | None) -> None:
    if model is not None and model != engine.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves '{engine.model_name}'",
            "model",
            "model_not_found",
        )


def check_priority(engine: ReplicaEngine, priority: int) -> None:
    """As vLLM: a priority other than 0 needs the priority scheduling policy (the engine checks it too)."""
    if not priority:
        return
    policy = engine.scheduling_policy
    if policy != "priority":
        raise bad_request(
            f"priority {priority} needs the priority scheduling policy (kvyard serve "
            f"--scheduling-policy priority); this replica schedules {policy}",
            "priority",
        )


def vocabulary_of(engine: ReplicaEngine, param: str) -> Vocabulary:
    if engine.vocabulary is None:
        raise bad_request("this model directory has no tokenizer; send token ids", param)
    return engine.vocabulary


def render_chat(
    engine: ReplicaEngine,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, object] | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    conversation = [_template_message(m) for m in messages]
    vocabulary = vocabulary_of(engine, "messages")
    tokens = vocabulary.render_chat(conversation, add_generation_prompt, template_kwargs, tools)
    if not tokens:
        raise bad_request("messages render to an empty prompt", "messages")
    return tokens


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it; a call's arguments as an object where they parse (templates that
    write them with `tojson` would otherwise write a string)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def _reject_unsupported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        raise bad_request(problem[1], problem[0], "unsupported_parameter")


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt lists hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
    return list(prompt)  # type: ignore[arg-type]


def _tokens_of(engine: ReplicaEngine, prompt: str | list[int], index: int, count: int) -> list[int]:
    what = f"prompt {index}" if count > 1 else "prompt"
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{what} is empty", "prompt")
        tokens = vocabulary_of(engine, "prompt").encode(prompt)  # adds BOS where the tokenizer wants one
    else:
        tokens = prompt
    check_token_ids(tokens, engine.limits.vocab_size, what)  # the length is checked with max_tokens
    return tokens

"""Tool calling in `/v1/chat/completions`: what the request allows (`tools`, `tool_choice`), and the model's
output read back as `tool_calls`, whole or streamed.

`tool_choice: auto` leaves the model free: a parser for the model's own call format (Hermes/Qwen `<tool_call>`
tags around JSON, or Llama 3's bare JSON object) finds the calls in its text. `required` and a named function
constrain decoding instead (structured_output): the output must be a JSON array of `{"name", "parameters"}`
objects of the listed tools, or the named function's arguments; the calls are then read from that JSON,
whatever the model's format, so they are valid for any model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvyard.api.errors import bad_request
from kvyard.api.protocol import ChatCompletionRequest
from kvyard.engine.sampling.structured_output import StructuredOutput
from kvyard.server.options import TOOL_CALL_PARSERS


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, serialised
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


class ToolParser(Protocol):
    def content_end(self, text: str, finished: bool) -> int:
        """How much of `text` (the output so far) is plain content a stream may send now: up to the start of
        the first call, less any tail that may yet turn out to start one."""
        ...

    def calls(self, text: str, finished: bool) -> list[ToolCall] | None:
        """The calls complete in `text` so far (all of them, once `finished`); None if a call in it is not
        valid JSON of a name and arguments, in which case the whole output is plain content."""
        ...


@dataclass(frozen=True, slots=True)
class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes, Qwen 2.5 and Qwen 3 write calls."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def content_end(self, text: str, finished: bool) -> int:
        found = text.find(self.start)
        if found >= 0:
            return found
        return len(text) if finished else len(text) - _partial_marker(text, self.start)

    def calls(self, text: str, finished: bool) -> list[ToolCall] | None:
        pieces = text.split(self.start)[1:]
        calls = []
        for number, piece in enumerate(pieces):
            body, closed, _ = piece.partition(self.end)
            if not closed and not (finished and number == len(pieces) - 1):
                break  # still being written
            call = _call_from_json(body, "arguments")
            if call is None:
                return None
            calls.append(call)
        return calls


@dataclass(frozen=True, slots=True)
class Llama3JsonParser:
    """Llama 3.1's JSON calls: the whole answer is `{"name": ..., "parameters": {...}}` (several: `; `-joined),
    optionally after `<|python_tag|>`."""

    tag: str = "<|python_tag|>"

    def content_end(self, text: str, finished: bool) -> int:
        head = text.lstrip()
        if head.startswith(("{", self.tag)) or (not finished and self.tag.startswith(head)):
            return 0
        return len(text)

    def calls(self, text: str, finished: bool) -> list[ToolCall] | None:
        head = text.lstrip().removeprefix(self.tag).strip()
        if not finished or not head.startswith("{"):
            return []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(head):
            try:
                value, position = decoder.raw_decode(head, position)
            except json.JSONDecodeError:
                return None
            call = _call_from_value(value, "parameters")
            if call is None:
                return None
            calls.append(call)
            while position < len(head) and head[position] in "; \t\n":
                position += 1
        return calls


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        return _call_from_value(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def _call_from_value(call: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get(arguments_key, call.get("arguments", call.get("parameters", {})))
    if isinstance(arguments, str):
        return ToolCall(call["name"], arguments)
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """The parser `name`, or for "auto" the one the chat template writes calls for."""
    if name == "auto":
        name = (
            "llama3_json"
            if chat_template
            and "<tool_call>" not in chat_template
            and ("ipython" in chat_template or '"parameters"' in chat_template)
            else "hermes"
        )
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_CALL_PARSERS)}")


# ---------------------------------------------------------------------------- what a request allows


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request's output becomes tool calls."""

    mode: Literal["auto", "required", "named"]
    parser: ToolParser
    function: str | None = None  # the named function

    def calls(self, text: str, finished: bool) -> list[ToolCall] | None:
        if self.mode == "named":
            return [ToolCall(str(self.function), text)] if finished else []
        if self.mode == "required":
            return _calls_from_array(text) if finished else []
        return self.parser.calls(text, finished)

    def content_end(self, text: str, finished: bool) -> int:
        return self.parser.content_end(text, finished) if self.mode == "auto" else 0


def _calls_from_array(text: str) -> list[ToolCall] | None:
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(calls, list):
        return None
    return [
        ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
        for c in calls
        if isinstance(c, dict) and isinstance(c.get("name"), str)
    ]


def plan_tools(body: ChatCompletionRequest, parser: ToolParser) -> tuple[ToolPlan | None, StructuredOutput | None]:
    """The request's tool plan and the constraint on its output (for `required` and a named function)."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (not tools and choice == "auto"):
        return None, None
    if not tools:
        raise bad_request(f"tool_choice {_choice_text(choice)} needs tools", "tool_choice")
    by_name = {tool.function.name: tool.function for tool in tools}
    if choice == "auto":
        return ToolPlan("auto", parser), None
    if choice == "required":
        return ToolPlan("required", parser), _required_schema(by_name, body.parallel_tool_calls)
    assert not isinstance(choice, str)
    function = by_name.get(choice.function.name)
    if function is None:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
    schema = function.parameters or {"type": "object"}
    return ToolPlan("named", parser, function.name), StructuredOutput.json_schema(schema, "tools")


def _required_schema(functions: dict[str, Any], parallel: bool) -> StructuredOutput:
    call_schemas = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": function.parameters or {"type": "object"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, function in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema, "tools")


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"


def tools_for_template(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tool list the chat template renders; none when the request forbids calls."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


# ---------------------------------------------------------------------------- streaming


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's tool-call progress: content sent, and calls already announced."""

    plan: ToolPlan
    sent_calls: list[ToolCall] = field(default_factory=list)
    sent_arguments: int = 0  # characters of a named call's arguments already streamed

    def delta(self, text: str, sent_chars: int, finished: bool) -> tuple[dict[str, Any], int]:
        """The delta to send for the output `text`, given `sent_chars` of content already sent, and the new
        number of content characters sent."""
        delta: dict[str, Any] = {}
        calls = self.plan.calls(text, finished)
        # An output whose calls do not parse is plain content, all of it.
        end = len(text) if finished and calls is None else self.plan.content_end(text, finished)
        if end > sent_chars:
            delta["content"] = text[sent_chars:end]
            sent_chars = end
        if self.plan.mode == "named":
            delta.update(self._named_delta(text))
        elif calls:
            new = calls[len(self.sent_calls) :]
            if new:
                first = len(self.sent_calls)
                delta["tool_calls"] = [call.json(first + i) for i, call in enumerate(new)]
                self.sent_calls += new
        return delta, sent_chars

    def _named_delta(self, text: str) -> dict[str, Any]:
        """A named call streams its arguments as they are generated: the first delta carries its id and name."""
        if not self.sent_calls:
            self.sent_calls.append(ToolCall(str(self.plan.function), ""))
            head = self.sent_calls[0].json(0)
            head["function"]["arguments"] = text
            self.sent_arguments = len(text)
            return {"tool_calls": [head]}
        if len(text) > self.sent_arguments:
            piece, self.sent_arguments = text[self.sent_arguments :], len(text)
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        return {}

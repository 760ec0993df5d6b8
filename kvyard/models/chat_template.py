"""Chat templates rendered the way Hugging Face `transformers` renders them, without importing it.

A chat template is Jinja code shipped with a checkpoint, so it is untrusted: it runs in jinja2's immutable
sandbox, and the values it sees are rebuilt from plain JSON types. The environment follows transformers' (as of
v5): `trim_blocks` and `lstrip_blocks`, loop controls, a `{% generation %}` block, a `tojson` that does not escape
HTML, `raise_exception`, `strftime_now`, and `dict`/`namespace` that refuse underscore names. Messages get the
same preparation: keys whose value is None are dropped, reasoning is offered under all its names, and
`continue_final_message` cuts the text after the final message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

# A message's reasoning, under the names templates read it by; the first is the standard one.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads it as declared on Extension

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses attributes starting with an underscore (a way towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja2's own Namespace takes self from args too, so that namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class TemplateDict:
    """`dict(...)` for templates: builds plain dicts, exposes nothing else of the dict type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in its sandbox; raises jinja2.TemplateSyntaxError for a broken one."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(source)


def render_chat_template(
    template: jinja2.Template,
    source: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """The conversation rendered to text; `source` is the template's text (checked by `continue_final_message`),
    `variables` the special tokens and any extra keyword arguments the template reads."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            raise ValueError("Tools should be JSON schemas (dicts)")
    for document in documents or ():
        if not isinstance(document, Mapping):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _alias_reasoning([_without_none(message) for message in plain_template_data(list(messages))])
    continued = _tag_final_message(chat, continue_final_message, source) if continue_final_message else None
    rendered: str = template.render(
        messages=chat,
        tools=plain_template_data(tools),
        documents=plain_template_data(documents),
        add_generation_prompt=add_generation_prompt,
        **plain_template_data(dict(variables or {})),
    )
    return _cut_after_final_message(rendered, continued) if continued is not None else rendered


def plain_template_data(value: Any) -> Any:
    """`value` rebuilt from exact JSON types (str, int, float, bool, None, dict, list, tuple); anything else becomes
    an inert "<TypeName>" string, so the sandbox never sees an object with methods it does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(key): plain_template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _without_none(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    return {key: item for key, item in message.items() if item is not None}


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(chat: list[dict[str, Any]], continue_final_message: bool | str, source: str) -> str:
    """Appends a tag to the final message's text (in place) and returns that text, so the render can be cut there."""
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning goes by several names: the template may read any of them
        fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final]
    if not any(name in source for name in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
        )
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if "text" in part:
                text: str = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    for name in fields:
        chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    return str(final)


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space, and so the tag's


def _check_attribute_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)

"""Constrained decoding: outputs that must match a JSON schema, any JSON object, a regular expression, a choice
of strings or a Lark grammar, enforced token by token with llguidance's matchers.

Each step, every constrained request's matcher computes the set of tokens that keep its output a prefix of a
sentence of the grammar (a bitmask over the vocabulary, all requests at once on llguidance's threads); the
sampler sets every other token's logit to -inf. The sampled token advances the matcher; when the grammar
admits nothing more, the request ends (`stop`), so a constrained output that ends is a complete sentence.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvyard.api.errors import InputError
from kvyard.models.tokenizer import PlainTokenizer

if TYPE_CHECKING:  # torch and llguidance load with the first constrained request; the core imports neither
    import torch

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_object", "json_schema", "regex", "choice", "grammar")
# Whitespace allowed between JSON tokens: one space, or a newline and up to 16 spaces or tabs of indentation
# (pretty-printed JSON, eight levels deep at two spaces). Any whitespace at all, as JSON itself allows, lets a
# model that likes it (the demo model was trained on indented code; random weights) pad every separator and
# fill max_tokens before the object closes.
JSON_WHITESPACE = r"(?:\n[\x20\x09]{0,16}|\x20)"
COMPILED_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must match. `spec`: the JSON schema (serialised), the regular expression, the
    choices (a JSON list of strings) or the Lark grammar; empty for `json_object`."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"  # the request field it came from, named in errors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, param: str = "response_format") -> StructuredOutput:
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        return cls("json_schema", text, param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str = "response_format") -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)), param)


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("compiler", "matcher")

    def __init__(self, matcher: Any, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the matcher is then in error)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The output is a complete sentence and nothing may follow it."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())


def allowed_tokens(matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
    """A bool tensor [len(matchers), vocab_size]: which tokens each matcher allows next. One engine's matchers
    share its compiler."""
    return matchers[0].compiler.allowed_tokens(matchers)


class GrammarCompiler:
    """Turns a StructuredOutput into matchers for one tokenizer; compiled grammars are cached by spec.

    Building the token trie takes about a second for a 150k-token vocabulary, so it happens on the first
    constrained request, not at start-up."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import torch

        self._llguidance = llguidance
        self._torch = torch
        self.vocab_size = vocab_size
        self.tokenizer = _grammar_tokenizer(llguidance, tokenizer, vocab_size)
        self.executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._bit_positions = torch.arange(32, dtype=torch.int32)

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar; InputError naming the field if it does not compile."""
        grammar = self._grammar(structured)
        matcher = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            self._compiled.pop(structured, None)
            raise InputError(f"{structured.param}: cannot be compiled: {matcher.get_error()}", structured.param)
        return GrammarMatcher(matcher, self)

    def allowed_tokens(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """A bool tensor [len(matchers), vocab_size]: which tokens each matcher (of this compiler) allows next,
        computed on llguidance's threads."""
        torch = self._torch
        words = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        pairs = [(item.matcher, index) for index, item in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, words.data_ptr(), words.shape[1] * 4, len(matchers))
        bits = (words[:, :, None] >> self._bit_positions) & 1
        return bits.reshape(len(matchers), -1)[:, : self.vocab_size].bool()

    def _grammar(self, structured: StructuredOutput) -> str:
        grammar = self._compiled.get(structured)
        if grammar is None:
            grammar = checked_grammar(structured, self.tokenizer)
            self._compiled[structured] = grammar
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        return grammar


@dataclass(slots=True)
class Grammars:
    """The engine's grammar matchers for one tokenizer; the compiler is built on the first constrained request."""

    tokenizer: Any
    vocab_size: int
    _compiler: GrammarCompiler | None = None

    def matcher(self, structured: StructuredOutput, resumed_output_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher past `resumed_output_ids` (another replica's output being continued); InputError naming the
        field when there is no tokenizer, the grammar does not compile, or the output already breaks it."""
        if self.tokenizer is None:
            raise InputError(
                f"{structured.param} needs a tokenizer, and this model directory has none", structured.param
            )
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        grammar = self._compiler.matcher(structured)
        if not all(grammar.accept(token_id) for token_id in resumed_output_ids):
            raise InputError(f"resume.token_ids do not match the request's {structured.param}", "resume.token_ids")
        return grammar


def checked_grammar(structured: StructuredOutput, tokenizer: Any = None) -> str:
    """llguidance's grammar for `structured`, checked (against `tokenizer` when given); InputError naming the
    request field if it is not a grammar llguidance can run (a bad schema, regex or Lark text)."""
    from llguidance import LLMatcher

    grammar = _grammar_source(structured)
    problem = LLMatcher.validate_grammar(grammar, tokenizer)
    if problem and not problem.startswith("WARNING"):
        raise InputError(f"{structured.param}: cannot be compiled: {problem}", structured.param)
    return grammar


def _grammar_source(structured: StructuredOutput) -> str:
    from llguidance import LLMatcher

    options: Any = {"whitespace_pattern": JSON_WHITESPACE}
    try:
        if structured.kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options))
        if structured.kind == "json_schema":
            return str(LLMatcher.grammar_from_json_schema(_closed_objects(structured.spec), defaults=options))
        if structured.kind == "regex":
            return str(LLMatcher.grammar_from_regex(structured.spec))
        if structured.kind == "choice":
            choices = json.loads(structured.spec)
            return str(LLMatcher.grammar_from_regex("|".join(f"(?:{_literal(c)})" for c in choices)))
        return str(LLMatcher.grammar_from_lark(structured.spec))
    except ValueError as error:
        raise InputError(f"{structured.param}: {error}", structured.param) from None


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else")


def _closed_objects(spec: str) -> str:
    """The schema with `additionalProperties: false` on every object schema that lists `properties` and does not
    say (as vLLM's default backend reads schemas): otherwise a model may pad an object with keys of its own until
    `max_tokens`. Members of an `allOf` stay open, since each lists only part of the properties."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return spec  # llguidance names what is wrong with it
    return json.dumps(_close(schema, in_all_of=False))


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    says = "additionalProperties" in closed or "unevaluatedProperties" in closed
    if "properties" in closed and not says and not in_all_of:
        closed["additionalProperties"] = False
    for key in _SUBSCHEMAS:
        if key in closed:
            closed[key] = _close(closed[key], in_all_of=False)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [_close(member, in_all_of=False) for member in closed[key]]
    if isinstance(closed.get("allOf"), list):
        closed["allOf"] = [_close(member, in_all_of=True) for member in closed["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: _close(member, in_all_of=False) for name, member in closed[key].items()}
    return closed


_REGEX_META = frozenset("\\.+*?()|[]{}^$-#&~")


def _literal(text: str) -> str:
    """`text` as a regular expression matching exactly it (meta characters escaped, nothing else)."""
    return "".join("\\" + char if char in _REGEX_META else char for char in text)


def _grammar_tokenizer(llguidance: Any, tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the vocabulary, built from the tokenizer.json pipeline either kind of tokenizer holds."""
    if isinstance(tokenizer, PlainTokenizer):
        return llguidance.LLTokenizer(
            tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
        )
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

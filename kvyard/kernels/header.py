"""A strict reader of C prototypes: the declarations in kvyard_kernels.h, and the bindings' own.

It reads only the simple form the kernel header keeps to (see the header's opening comment) and
rejects anything else with `HeaderSyntaxError`, rather than guessing: a prototype it half understood
would make the load-time check against the bindings say less than it seems to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE_TYPES = ("void", "int", "float", "int64_t", "int8_t", "uint16_t")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_TOKEN = re.compile(r"\s*(?:([A-Za-z_]\w*)|([*(),]))")
_KEYWORDS = frozenset({"const", *BASE_TYPES})


class HeaderSyntaxError(ValueError):
    """The text holds something other than the simple prototypes this reader accepts."""


@dataclass(frozen=True, slots=True)
class CType:
    base: str  # one of BASE_TYPES
    pointer: bool = False
    const: bool = False  # a const pointee: `const float *`

    def __str__(self) -> str:
        return f"{'const ' if self.const else ''}{self.base}{' *' if self.pointer else ''}"


@dataclass(frozen=True, slots=True)
class Parameter:
    type: CType
    name: str

    def __str__(self) -> str:
        return f"{self.type}{'' if self.type.pointer else ' '}{self.name}"


@dataclass(frozen=True, slots=True)
class Prototype:
    name: str
    returns: CType
    parameters: tuple[Parameter, ...]

    def __str__(self) -> str:
        params = ", ".join(str(p) for p in self.parameters) or "void"
        return f"{self.returns}{'' if self.returns.pointer else ' '}{self.name}({params})"


def parse_prototypes(text: str) -> dict[str, Prototype]:
    """Every prototype declared in `text`, by function name, in order of declaration."""
    code = _without_preprocessor(_COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text))
    *statements, rest = code.split(";")
    if rest.strip():
        raise HeaderSyntaxError(f"line {_line_of(code, len(code) - len(rest))}: declaration without ';': {_show(rest)}")
    prototypes: dict[str, Prototype] = {}
    offset = 0
    for statement in statements:
        if statement.strip():
            prototype = _parse_statement(statement, _line_of(code, offset + len(statement) - len(statement.lstrip())))
            if prototype.name in prototypes:
                raise HeaderSyntaxError(f"{prototype.name} is declared twice")
            prototypes[prototype.name] = prototype
        offset += len(statement) + 1
    return prototypes


def _without_preprocessor(code: str) -> str:
    """Blank out directive lines (include guards, includes), keeping line numbers."""
    lines = code.split("\n")
    for number, line in enumerate(lines, start=1):
        if line.lstrip().startswith("#"):
            if line.rstrip().endswith("\\"):
                raise HeaderSyntaxError(f"line {number}: continued preprocessor lines are not supported")
            lines[number - 1] = ""
    return "\n".join(lines)


def _parse_statement(statement: str, line: int) -> Prototype:
    return _Statement(_tokenize(statement, line), f"line {line}: {_show(statement)}").prototype()


@dataclass(slots=True)
class _Statement:
    """A recursive-descent reader over one declaration's tokens."""

    tokens: list[str]
    where: str  # the declaration, for error messages
    position: int = 0

    def prototype(self) -> Prototype:
        returns = self.type()
        name = self.name()
        self.take("(")
        parameters: list[Parameter] = []
        if self.tokens[self.position : self.position + 2] == ["void", ")"]:
            self.take()
        else:
            parameters.append(self.parameter())
            while self.peek() == ",":
                self.take()
                parameters.append(self.parameter())
        self.take(")")
        if self.position != len(self.tokens):
            raise self.error(f"unexpected {self.tokens[self.position]!r} after the parameter list")
        return Prototype(name, returns, tuple(parameters))

    def parameter(self) -> Parameter:
        param_type = self.type()
        if param_type == CType("void"):
            raise self.error("a parameter cannot be void")
        return Parameter(param_type, self.name())

    def type(self) -> CType:
        const = self.peek() == "const"
        if const:
            self.take()
        base = self.take()
        if base not in BASE_TYPES:
            raise self.error(f"type {base!r} is not one of {', '.join(BASE_TYPES)}")
        pointer = self.peek() == "*"
        if pointer:
            self.take()
        if self.peek() in ("*", "const"):
            raise self.error("only single pointers, with an optional const pointee, are supported")
        if const and not pointer:
            raise self.error(f"const is supported only on a pointee (`const {base} *`)")
        return CType(base, pointer, const)

    def name(self) -> str:
        name = self.take()
        if not name.isidentifier() or name in _KEYWORDS:
            raise self.error(f"expected a name, found {name!r}")
        return name

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None:
            raise self.error("the declaration ends early")
        if expected is not None and token != expected:
            raise self.error(f"expected {expected!r}, found {token!r}")
        self.position += 1
        return token

    def error(self, message: str) -> HeaderSyntaxError:
        return HeaderSyntaxError(f"{self.where}: {message}")


def _tokenize(statement: str, line: int) -> list[str]:
    tokens: list[str] = []
    position = 0
    while statement[position:].strip():
        match = _TOKEN.match(statement, position)
        if match is None:
            bad = statement[position:].lstrip()[:1]
            raise HeaderSyntaxError(f"line {line}: unsupported character {bad!r} in {_show(statement)}")
        tokens.append(match.group(1) or match.group(2))
        position = match.end()
    return tokens


def _line_of(code: str, offset: int) -> int:
    return code.count("\n", 0, offset) + 1


def _show(text: str) -> str:
    return repr(" ".join(text.split())[:120])

"""Settings declared once: dataclass fields with help text, from which the CLI and keyword APIs are built.

A config dataclass declares each user-facing setting with `setting(default, help=...)`; a field of
another config dataclass type nests that config (the engine's `scheduler`, for instance), unless it is itself
declared with `setting`: then the dataclass is the setting's value (a length range). The command
line (`kvyard.cli.options`) turns every setting into an option with its help and default, and
`from_flat` builds a nested config from flat keyword arguments (`LLM(model, max_num_seqs=8)`), so no
setting is written twice.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field
from typing import Any, TypeVar

Config = TypeVar("Config")


def setting(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    default_text: str | None = None,
    secret: bool = False,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A user-facing field: `help` is its documentation; `flag` overrides the option name (`--field-name`);
    `default_text` says what the default means where its value alone would not (a None that is resolved);
    a `secret` (a key, a URL with a password) stays out of the dataclass's repr, so logs never show it;
    `parse` reads the option's text where the type alone cannot (`128:512`), its ValueError naming what is wrong."""
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "metavar": metavar,
        "default_text": default_text,
        "parse": parse,
    }
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, repr=not secret)
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def is_setting(item: Field[Any]) -> bool:
    return "help" in item.metadata


def field_types(cls: type) -> dict[str, Any]:
    """The fields' types, resolved (the modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def nested_config(annotation: Any) -> type | None:
    """The config dataclass a field nests (`X` or `X | None`), or None for a plain value."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def optional_inner(annotation: Any) -> tuple[Any, bool]:
    """(`X`, True) for `X | None`, else (annotation, False)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


def walk_settings(cls: type) -> Iterator[tuple[type, Field[Any], Any]]:
    """Every setting of `cls` and of the configs it nests, depth first: (owning class, field, type)."""
    types_of = field_types(cls)
    for item in dataclasses.fields(cls):
        nested = _nested(item, types_of[item.name])
        if nested is not None:
            yield from walk_settings(nested)
        elif is_setting(item):
            yield cls, item, types_of[item.name]


def _nested(item: Field[Any], annotation: Any) -> type | None:
    """The config a field nests; a setting nests none, whatever its type."""
    return None if is_setting(item) else nested_config(annotation)


def from_flat(cls: type[Config], values: Mapping[str, Any], **fixed: Any) -> Config:
    """`cls` built from flat keyword values: each name goes to the (possibly nested) field that declares it.

    A nested config given whole (`kv_tier=KVTierConfig(...)`) is used as it is. Unknown names are a
    TypeError, as for any function call."""
    known = {name for _, item, _ in walk_settings(cls) for name in [item.name]}
    known |= {item.name for item in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known - set(fixed))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(map(repr, unknown))}")
    return _build(cls, {**values, **fixed})


def _build(cls: type[Config], values: Mapping[str, Any]) -> Config:
    types_of = field_types(cls)
    arguments: dict[str, Any] = {}
    for item in dataclasses.fields(cls):  # type: ignore[arg-type]
        nested = _nested(item, types_of[item.name])
        if item.name in values:
            arguments[item.name] = values[item.name]
        elif nested is not None and any(name in values for name in _names(nested)):
            arguments[item.name] = _build(nested, values)
    return cls(**arguments)


def _names(cls: type) -> set[str]:
    return {item.name for _, item, _ in walk_settings(cls)}

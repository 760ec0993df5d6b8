"""Command-line options generated from config dataclasses (`kvyard.settings`): one option per setting.

Each setting becomes `--field-name` (or its declared `flag`), with the field's help text and default.
Booleans get `--x / --no-x`; `X | None` takes an X; tuples take a comma-separated list; lists repeat the
option; a setting with its own `parse` is read by it. Nested configs get their own group in `--help`.
"""

from __future__ import annotations

import argparse
import logging
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Any, TypeVar

from kvyard.settings import from_flat, optional_inner, walk_settings

Config = TypeVar("Config")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_config_options(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    exclude: Collection[str] = (),
    shown_defaults: Mapping[str, str] | None = None,
) -> None:
    """One option per setting of `cls` (and of the configs it nests). `defaults` overrides field defaults;
    `shown_defaults` says in words what a default means where the value alone would not."""
    defaults, shown_defaults = defaults or {}, shown_defaults or {}
    groups: dict[type, argparse._ArgumentGroup] = {}
    for owner, item, annotation in walk_settings(cls):
        if item.name in exclude:
            continue
        if owner not in groups:
            name, description = (title, None) if owner is cls and title else _group_title(owner)
            groups[owner] = parser.add_argument_group(name, description)
        if item.name in defaults:
            default, shown = defaults[item.name], shown_defaults.get(item.name)
        else:
            default, shown = _field_default(item), item.metadata.get("default_text")
        _add_option(groups[owner], item, annotation, default, shown)


def config_from_args(cls: type[Config], args: argparse.Namespace, **fixed: Any) -> Config:
    """`cls` from the parsed options that belong to it (nested configs included), plus `fixed` values."""
    repeated = {item.name for _, item, kind in walk_settings(cls) if typing.get_origin(kind) is list}
    names = {item.name for _, item, _ in walk_settings(cls)}
    values = {name: value for name, value in vars(args).items() if name in names}
    values = {name: value for name, value in values.items() if not (name in repeated and value is None)}
    return from_flat(cls, values, **fixed)


def _add_option(
    group: argparse._ArgumentGroup, item: Field[Any], annotation: Any, default: Any, shown: str | None
) -> None:
    flag = item.metadata.get("flag") or "--" + item.name.replace("_", "-")
    inner, optional = optional_inner(annotation)
    help_text = item.metadata["help"]
    if shown or not (default is None and "(none:" in help_text):  # the help already says what none means
        help_text += f" (default: {shown or _show(default)})"
    metavar = item.metadata.get("metavar") or flag.removeprefix("--").upper().replace("-", "_")
    common: dict[str, Any] = {"dest": item.name, "default": default, "help": help_text}
    if inner is not bool and not item.metadata.get("choices"):
        common["metavar"] = metavar
    if item.metadata.get("choices"):
        common["choices"] = item.metadata["choices"]
    if item.metadata.get("parse"):
        group.add_argument(flag, type=_parsed_by(item.metadata["parse"]), **common)
    elif inner is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif typing.get_origin(inner) is tuple:
        group.add_argument(flag, type=_comma_list(typing.get_args(inner)[0]), **common)
    elif typing.get_origin(inner) is list:
        common["default"] = None if default in (None, []) else default
        group.add_argument(flag, action="append", type=typing.get_args(inner)[0], **common)
    elif inner in (int, float, str, Path):
        group.add_argument(flag, type=inner, **common)
    else:
        raise TypeError(f"setting {item.name}: no command-line form for {annotation}{' | None' if optional else ''}")


def _field_default(item: Field[Any]) -> Any:
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        return item.default_factory()
    return None


def _parsed_by(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An option type whose error is `parse`'s own message, not argparse's "invalid value"."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    return convert


def _comma_list(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(part.strip()) for part in text.split(",") if part.strip())

    return parse


def _show(value: Any) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _group_title(cls: type) -> tuple[str, str | None]:
    """("engine", "the model, its KV cache and its kernels") from a docstring that starts "Engine: the model..."."""
    first_line = (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")
    name, _, description = first_line.partition(": ")
    return name.lower(), description or None


def add_log_level_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="warning", choices=LOG_LEVELS, type=str.lower, help="logging level (default: warning)"
    )


def configure_logging(level: str) -> None:
    """Log lines with their time: warnings about replicas are read against benchmark and client timelines."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

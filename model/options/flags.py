"""How an option becomes a command-line flag: each field of an options group carries its `Flag`
(name, help, value parser, ...), and the parser is generated from the fields, one argument group
per options group, so a flag, its field and its default are stated once (model/options/groups.py).

`option(default, Flag(...))` declares a field with a flag; `group(Cls)` nests an options group.
`add_flags` registers every flag of an options class on a parser; `read_options` builds the class
from the parsed namespace; `from_fields` builds it from flat field names (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs

_FLAG = "mlx_trio.flag"
_GROUP = "mlx_trio.group"
T = TypeVar("T")


@attrs.frozen
class Flag:
    """One field's flag. `help` says what it does; `--help` adds the default when the help text
    does not state it (`shown` names a default the value alone would not explain)."""

    name: str
    help: str
    parse: Callable[[str], Any] | None = None  # the value parser (argparse's `type`)
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    action: str | type[argparse.Action] | None = None  # "store_true", "store_false", "append" or a class
    nargs: str | None = None
    env: str | None = None  # a secret's environment variable: the default when the flag is absent
    shown: str | None = None  # how --help states the default (None: the value itself)


def option(default: Any = None, flag: Flag | None = None, *, converter: Callable[[Any], Any] | None = None) -> Any:
    """A field of an options group: its one default, and its flag (None: not on the command line)."""
    return attrs.field(default=default, converter=converter, metadata={_FLAG: flag})


def group(cls: type[T]) -> T:
    """A field holding a whole options group (its own defaults)."""
    return attrs.field(factory=cls, metadata={_GROUP: cls})


def default_of(cls: type, name: str) -> Any:
    """The one default of option `name` in group `cls`, for a value type that carries the option
    (a KV scheme's start, a speculation's draft length) without stating a default of its own."""
    return attrs.fields_dict(cls)[name].default


def subgroups(cls: type) -> Iterator[tuple[str, type]]:
    """(field name, options class) of each group `cls` nests."""
    for field in attrs.fields(cls):
        if _GROUP in field.metadata:
            yield field.name, field.metadata[_GROUP]


def flagged_fields(cls: type) -> Iterator[tuple[attrs.Attribute, Flag]]:
    """Each field of `cls` (not nested) that has a flag, with it."""
    for field in attrs.fields(cls):
        flag = field.metadata.get(_FLAG)
        if flag is not None:
            yield field, flag


def field_groups(cls: type) -> dict[str, type]:
    """Every leaf field name of `cls` (through nested groups) → the options class that holds it.
    Names are unique across groups (a flat name finds its group), checked here."""
    out: dict[str, type] = {}
    for field in attrs.fields(cls):
        if _GROUP in field.metadata:
            for name, owner in field_groups(field.metadata[_GROUP]).items():
                if name in out:
                    raise TypeError(f"option {name!r} is declared in both {out[name].__name__} and {owner.__name__}")
                out[name] = owner
        else:
            out[field.name] = cls
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Every flag of `cls`: one argument group per options group, titled by its docstring's
    first line, in declaration order."""
    for _, sub in subgroups(cls):
        add_flags(parser, sub)
    own = list(flagged_fields(cls))
    if not own:
        return
    title, _, description = (cls.__doc__ or cls.__name__).strip().partition("\n")
    arguments = parser.add_argument_group(title.rstrip("."), " ".join(description.split()) or None)
    for field, flag in own:
        default = field.default
        if flag.env is not None:
            default = os.environ.get(flag.env) or default
        if isinstance(default, tuple):
            default = list(default)  # argparse appends to a repeatable flag's default
        kwargs: dict[str, Any] = {"dest": field.name, "default": default, "help": _help(flag, field.default)}
        if flag.action is not None:
            kwargs["action"] = flag.action
        if flag.action not in ("store_true", "store_false"):
            if flag.parse is not None:
                kwargs["type"] = flag.parse
            for key in ("metavar", "choices", "nargs"):
                if getattr(flag, key) is not None:
                    kwargs[key] = getattr(flag, key)
        arguments.add_argument(flag.name, **kwargs)


def read_options(namespace: argparse.Namespace, cls: type[T]) -> T:
    """`cls` with every flagged field from the parsed `namespace` (nested groups too)."""
    values: dict[str, Any] = {name: read_options(namespace, sub) for name, sub in subgroups(cls)}
    values.update({field.name: getattr(namespace, field.name) for field, _ in flagged_fields(cls)})
    return cls(**values)


def from_fields(cls: type[T], values: Mapping[str, Any]) -> T:
    """`cls` with the given leaf fields set by their flat names; the rest keep their defaults."""
    owners = field_groups(cls)
    unknown = set(values) - set(owners)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}")
    built: T = _build(cls, values)
    return built


def _build(cls: Any, values: Mapping[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for field in attrs.fields(cls):
        if _GROUP in field.metadata:
            sub = field.metadata[_GROUP]
            mine = {name: value for name, value in values.items() if name in field_groups(sub)}
            kwargs[field.name] = _build(sub, mine)
        elif field.name in values:
            kwargs[field.name] = values[field.name]
    return cls(**kwargs)


def shown_default(flag: Flag, default: Any) -> str:
    """How the docs state a flag's default (a switch is off until given)."""
    if flag.shown is not None:
        return flag.shown
    return "off" if flag.action in ("store_true", "store_false") else _shown(default)


def _help(flag: Flag, default: Any) -> str:
    text = flag.help
    if "default" not in text:
        text = f"{text} (default {shown_default(flag, default)})"
    return text.replace("%", "%%")  # argparse %-formats help strings


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "none"
    return str(value)

"""The server's options as tests read them."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import attrs

from actors.options import parse_options
from model.options import ServerOptions
from model.options.flags import subgroups


def flat(options: ServerOptions) -> SimpleNamespace:
    """Every leaf field of `options` by its own name (`flat(o).batch` is `o.scheduling.batch`)."""
    values: dict[str, object] = {}

    def walk(node: Any) -> None:
        nested = dict(subgroups(type(node)))
        for field in attrs.fields(type(node)):
            value = getattr(node, field.name)
            if field.name in nested:
                walk(value)
            else:
                values.setdefault(field.name, value)

    walk(options)
    return SimpleNamespace(**values)


def parsed(argv: Sequence[str]) -> SimpleNamespace:
    """The command line's options, flat."""
    return flat(parse_options(list(argv)))

"""The value parsers of the command line's flags: each turns one flag's text into its field's value
or raises `argparse.ArgumentTypeError` (one line, exit 2). The API layer reads the options with
the same rules (`parse_hosts`, `parse_allow_ips`, `parse_origins`)."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from model.lora.ids import NO_ADAPTER, adapter_id_problem


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def auto_on_off(text: str) -> bool | None:
    """auto → None (the device's default), on → True, off → False."""
    choices: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
    if text not in choices:
        raise argparse.ArgumentTypeError("must be auto, on or off")
    return choices[text]


def port_number(text: str) -> int:
    """A TCP port; 0 asks the system for a free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be a port from 0 to 65535")
    return value


def file_mode(text: str) -> int:
    """File permissions in octal, as chmod takes them (600, 0660)."""
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError("must be octal permissions such as 600 or 660") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError("must be octal permissions from 000 to 777")
    return value


def path_arg(text: str) -> str:
    """A path flag's value with a leading `~` expanded, as the shell would have done for an
    unquoted one (a quoted "~/x" would otherwise be a directory named `~` in the working one)."""
    return os.path.expanduser(text)


def batch_rows(text: str) -> int | None:
    """`--batch auto` → None (sized at start-up), else an integer >= 1."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be auto or an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be auto or an integer >= 1")
    return value


def json_object(text: str) -> tuple[tuple[str, object], ...]:
    """A JSON object's (name, value) pairs, sorted by name (`--chat-template-args`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return sorted_items(value)


def sorted_items(value: Mapping[str, object] | Iterable[tuple[str, object]]) -> tuple[tuple[str, object], ...]:
    """A mapping (or its pairs) as (name, value) pairs sorted by name: a frozen option's value."""
    pairs = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted(pairs, key=lambda pair: pair[0]))


def default_adapter(text: str) -> str:
    """`--default-adapter`: an adapter id, or `none` (the base model)."""
    if text != NO_ADAPTER and (problem := adapter_id_problem(text)):
        raise argparse.ArgumentTypeError(problem)
    return text


def adapter_spec(text: str) -> tuple[str, str]:
    """`ID=PATH` → (id, path with `~` expanded)."""
    adapter_id, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError("must be ID=PATH")
    if problem := adapter_id_problem(adapter_id):
        raise argparse.ArgumentTypeError(problem)
    return adapter_id, path_arg(path)


_URL = re.compile(r"https?://[^/\s]+\S*")
TRACING_INSTALL_HINT = "pip install 'mlx-trio-server[otel]'"
# What the trace exporter needs: the SDK and its OTLP/HTTP exporter.
TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def otlp_url(text: str) -> str:
    if not _URL.fullmatch(text):
        raise argparse.ArgumentTypeError("must be an http:// or https:// URL")
    return text


def otel_installed() -> bool:
    try:
        return all(importlib.util.find_spec(name) is not None for name in TRACING_MODULES)
    except ImportError:  # a parent package missing
        return False


_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


def parse_allow_ips(values: Iterable[str] | str) -> tuple[str, ...]:
    """IPs and CIDRs (as `ipaddress` writes them) or `*`, each value possibly comma-separated.
    Raises ValueError for anything else."""
    out: list[str] = []
    for item in _items(values):
        if item != "*":
            try:
                item = str(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address, a CIDR network or *") from None
        if item not in out:
            out.append(item)
    return tuple(out)


def parse_hosts(values: Iterable[str] | str) -> tuple[str, ...]:
    """Host names (lowercased, a trailing dot dropped), IP addresses or `*`, each value possibly
    comma-separated. Raises ValueError for a value with a scheme, path or port."""
    out: list[str] = []
    for item in _items(values):
        name = item.lower().rstrip(".")
        if name != "*" and not _HOST_NAME.fullmatch(name) and not _is_ip(name.strip("[]")):
            raise ValueError(f"{item!r} is not a host name (give the name alone, without scheme or port)")
        if name not in out:
            out.append(name)
    return tuple(out)


def parse_origins(values: Iterable[str] | str) -> tuple[str, ...]:
    """`--cors-origin` values: each may hold several, comma-separated; trailing slashes dropped."""
    return tuple(dict.fromkeys(origin.rstrip("/") for origin in _items(values) if origin.rstrip("/")))


def listed(parse: Callable[[str], Iterable[Any]]) -> Callable[[str], tuple[Any, ...]]:
    """A comma-separated flag's value parser from `parse` (ValueError → one-line usage error)."""

    def convert(text: str) -> tuple[Any, ...]:
        try:
            return tuple(parse(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _items(values: Iterable[str] | str) -> list[str]:
    if isinstance(values, str):
        values = [values]
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class AppendAdapter(argparse.Action):
    """argparse's append, refusing an adapter id given twice (exit 2 with the usage line)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        given = list(getattr(namespace, self.dest) or [])  # a copy: never the shared default
        if any(adapter_id == values[0] for adapter_id, _ in given):
            parser.error(f"--adapter {values[0]} is given more than once")
        setattr(namespace, self.dest, [*given, values])


class CommaList(argparse.Action):
    """A repeatable flag of comma-separated values (parsed by `listed`); its first use replaces
    the default."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items += [value for value in values or () if value not in items]
        setattr(namespace, self.dest, items)


class NeedsOtel(argparse.Action):
    """Stores the URL once the OpenTelemetry packages are there; else one line and exit 2."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        if not otel_installed():
            parser.exit(2, f"{parser.prog}: error: {option} needs OpenTelemetry: {TRACING_INSTALL_HINT}\n")
        setattr(namespace, self.dest, values)

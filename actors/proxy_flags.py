"""Flags for serving behind a reverse proxy and to browsers: `--allowed-hosts` fills
`ServeConfig.allowed_hosts` (the Host names served, api/cross_site.py) and
`--forwarded-allow-ips` fills `ServeConfig.forwarded_allow_ips` (whose forwarding headers name
the client, api/forwarded.py). Both are repeatable and comma-separated; the value parsers here are
the only ones, so the API layer reads the options with the same rules."""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_FORWARDED_ALLOW_IPS = ("127.0.0.1", "::1")  # a proxy on the same host
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


def _flag_type(parse: Any) -> Any:
    def convert(text: str) -> tuple[str, ...]:
        try:
            return tuple(parse(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


class _CommaList(argparse.Action):
    """A repeatable flag of comma-separated values; its first use replaces the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        items += [value for value in values or () if value not in items]
        setattr(namespace, self.dest, items)


def add_proxy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-hosts",
        action=_CommaList,
        type=_flag_type(parse_hosts),
        default=(),
        metavar="NAME",
        help="Host names the server answers to, besides IP addresses, localhost and the --host name "
        "(repeatable or comma-separated; * = any): any other Host gets 403, a guard against DNS "
        "rebinding (default: none)",
    )
    p.add_argument(
        "--forwarded-allow-ips",
        action=_CommaList,
        type=_flag_type(parse_allow_ips),
        default=DEFAULT_FORWARDED_ALLOW_IPS,
        metavar="IPS",
        help="proxies whose X-Forwarded-For / Forwarded headers name the client in logs: IPs or CIDRs "
        "(repeatable or comma-separated; * = any peer; '' = none) (default: 127.0.0.1,::1)",
    )

"""Whose forwarding headers are believed, and the client address they give.

A reverse proxy connects from its own address and names the real client in `X-Forwarded-For`
(nginx, Caddy, HAProxy, Traefik) or `Forwarded: for=...` (RFC 7239). Anyone can send those
headers, so they are believed only from a peer in `--forwarded-allow-ips` (comma-separated IPs
or CIDRs, `*` = any peer; default `127.0.0.1,::1`, a proxy on the same host). The hops are
walked from the right (the nearest proxy's entry), skipping addresses that are themselves
allowed proxies; the first other one is the client, so entries a client forged to the left are
never reached. When every
hop is an allowed proxy, the leftmost is. With `*` the leftmost entry is taken as it is.
`X-Forwarded-For` wins when both are present (nginx appends to it but passes a client's own
`Forwarded` header through untouched). A hop that is not an IP address (`unknown`, an
obfuscated `_name`) ends the walk and the peer's own address is used.

The believed address is what the request log and traces show (api/observability/request_log.py). The admin
rule does not use it: with no `--admin-token`, only a loopback peer whose request carries none
of `PROXY_HEADERS` counts as local (api/http/security.py).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

import attrs

from model.options.values import parse_allow_ips

# Headers only a proxy adds: a request carrying any of them came through one.
PROXY_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip", "x-forwarded-host", "x-forwarded-proto", "via")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@attrs.frozen
class TrustedProxies:
    """The peers whose forwarding headers are believed."""

    networks: tuple[Network, ...] = ()
    any_peer: bool = False

    @classmethod
    def parse(cls, values: Iterable[str] | str) -> TrustedProxies:
        items = parse_allow_ips(values)
        networks = tuple(ipaddress.ip_network(item, strict=False) for item in items if item != "*")
        return cls(networks=networks, any_peer="*" in items)

    def trusts(self, host: str | None) -> bool:
        if self.any_peer:
            return True
        address = ip_of(host)
        return address is not None and any(address in network for network in self.networks)


def ip_of(text: str | None) -> Address | None:
    """An address from a peer or a header hop: `1.2.3.4`, `1.2.3.4:80`, `[::1]:80`, `::1`,
    `fe80::1%eth0`; IPv4-mapped IPv6 as IPv4. None for anything else."""
    if not text:
        return None
    text = text.strip().strip('"')
    if text.startswith("["):  # [v6] or [v6]:port
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # v4:port (a bare v6 address has two or more colons)
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def forwarded_hops(x_forwarded_for: Sequence[str], forwarded: Sequence[str]) -> list[str]:
    """The client chain the headers name, leftmost (the original client) first. Every header
    line counts, in order; `X-Forwarded-For` when present, else the `for=` of each `Forwarded`
    element."""
    if x_forwarded_for:
        return [hop.strip() for line in x_forwarded_for for hop in line.split(",") if hop.strip()]
    hops: list[str] = []
    for line in forwarded:
        for element in line.split(","):
            for pair in element.split(";"):
                name, _, value = pair.partition("=")
                if name.strip().lower() == "for" and value.strip():
                    hops.append(value.strip().strip('"'))
    return hops


def client_address(peer: str | None, hops: Sequence[str], trusted: TrustedProxies) -> str | None:
    """The client's address: `peer` itself unless it is a trusted proxy that forwarded `hops`."""
    if not hops or not trusted.trusts(peer):
        return peer
    chosen = hops[0]
    if not trusted.any_peer:  # the nearest hop that is not itself an allowed proxy
        chosen = next((hop for hop in reversed(hops) if not trusted.trusts(hop)), chosen)
    address = ip_of(chosen)
    return peer if address is None else str(address)


def scope_client_address(
    peer: str | None, headers: Iterable[tuple[bytes, bytes]], trusted: TrustedProxies
) -> str | None:
    """`client_address` for an ASGI scope's raw headers."""
    x_forwarded_for: list[str] = []
    forwarded: list[str] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"x-forwarded-for":
            x_forwarded_for.append(value.decode("latin-1"))
        elif lowered == b"forwarded":
            forwarded.append(value.decode("latin-1"))
    return client_address(peer, forwarded_hops(x_forwarded_for, forwarded), trusted)

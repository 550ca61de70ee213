"""Whose X-Forwarded-For / Forwarded headers are believed (api/http/forwarded.py), and the request log's
client address that follows."""

from __future__ import annotations

import json
import logging

import pytest

from api.http.forwarded import TrustedProxies, client_address, forwarded_hops, ip_of, scope_client_address
from tests.helpers.security_server import server

LOOPBACK = TrustedProxies.parse(["127.0.0.1,::1"])


def client(peer: str | None, xff: list[str] | None = None, forwarded: list[str] | None = None, trusted=LOOPBACK):
    return client_address(peer, forwarded_hops(xff or [], forwarded or []), trusted)


def test_addresses_as_proxies_write_them():
    assert str(ip_of("203.0.113.9")) == "203.0.113.9" and str(ip_of(" 203.0.113.9:4711 ")) == "203.0.113.9"
    assert str(ip_of("[2001:db8::1]:443")) == "2001:db8::1" and str(ip_of("2001:db8::1")) == "2001:db8::1"
    assert str(ip_of('"[::1]"')) == "::1" and str(ip_of("::ffff:10.0.0.1")) == "10.0.0.1"
    assert str(ip_of("fe80::1%eth0")) == "fe80::1"
    for text in (None, "", "unknown", "_hidden", "example.com", "1.2.3.4.5"):
        assert ip_of(text) is None, text


def test_only_an_allowed_peer_is_believed():
    assert client("127.0.0.1", ["203.0.113.9"]) == "203.0.113.9"
    assert client("::1", ["203.0.113.9"]) == "203.0.113.9"
    assert client("198.51.100.1", ["203.0.113.9"]) == "198.51.100.1"  # not a proxy of ours: its own address
    assert client("127.0.0.1", ["203.0.113.9"], trusted=TrustedProxies()) == "127.0.0.1"  # '' trusts nobody
    assert client(None, ["203.0.113.9"]) is None  # a unix socket peer is not an allowed proxy
    assert client("127.0.0.1") == "127.0.0.1"  # no header: the peer


def test_the_chain_is_walked_from_the_nearest_proxy():
    # A client can put anything at the left of the header; the nearest proxy appends the address
    # it saw, so the rightmost hop that is not an allowed proxy is the one to believe.
    assert client("127.0.0.1", ["6.6.6.6, 203.0.113.9"]) == "203.0.113.9"
    assert client("127.0.0.1", ["6.6.6.6", "203.0.113.9"]) == "203.0.113.9"  # several header lines
    proxies = TrustedProxies.parse("127.0.0.1,10.0.0.0/8")
    assert client("127.0.0.1", ["6.6.6.6, 203.0.113.9, 10.1.1.1"], trusted=proxies) == "203.0.113.9"
    assert client("127.0.0.1", ["10.2.2.2, 10.1.1.1"], trusted=proxies) == "10.2.2.2"  # all proxies: leftmost
    assert client("127.0.0.1", ["6.6.6.6, 203.0.113.9"], trusted=TrustedProxies.parse("*")) == "6.6.6.6"
    assert client("127.0.0.1", ["203.0.113.9, unknown"]) == "127.0.0.1"  # not an address: the peer's own


def test_forwarded_header():
    assert client("127.0.0.1", forwarded=["for=192.0.2.60;proto=http;by=203.0.113.43"]) == "192.0.2.60"
    assert client("127.0.0.1", forwarded=['for="[2001:db8:cafe::17]:4711"']) == "2001:db8:cafe::17"
    assert client("127.0.0.1", forwarded=["for=6.6.6.6, For=203.0.113.9"]) == "203.0.113.9"
    assert client("127.0.0.1", forwarded=["for=_hidden"]) == "127.0.0.1"
    # X-Forwarded-For wins: nginx appends to it but passes a client's own Forwarded through.
    assert client("127.0.0.1", ["203.0.113.9"], ["for=6.6.6.6"]) == "203.0.113.9"


def test_scope_headers():
    headers = [(b"X-Forwarded-For", b"6.6.6.6, 203.0.113.9"), (b"host", b"x")]
    assert scope_client_address("127.0.0.1", headers, LOOPBACK) == "203.0.113.9"
    assert scope_client_address("127.0.0.1", [(b"forwarded", b"for=203.0.113.7")], LOOPBACK) == "203.0.113.7"


def test_allow_ips_are_checked():
    assert TrustedProxies.parse("10.0.0.0/8").trusts("10.9.9.9") and not TrustedProxies.parse("10.0.0.0/8").trusts(
        "11.0.0.1"
    )
    assert TrustedProxies.parse("::1").trusts("::1") and not TrustedProxies.parse("::1").trusts("127.0.0.1")
    with pytest.raises(ValueError, match="not an IP address"):
        TrustedProxies.parse("proxy.lan")


def logged_clients(caplog) -> list[str | None]:
    lines = [r.getMessage() for r in caplog.records if r.name == "mlx_trio.requests"]
    return [json.loads(line.removeprefix("request "))["client"] for line in lines]


@pytest.mark.parametrize(
    ("allow", "peer", "logged"),
    [
        (("127.0.0.1", "::1"), "127.0.0.1", "203.0.113.9"),  # the default: a proxy on this host
        (("127.0.0.1", "::1"), "198.51.100.1", "198.51.100.1"),
        (("10.0.0.0/8",), "10.0.0.5", "203.0.113.9"),
        ((), "127.0.0.1", "127.0.0.1"),
    ],
)
async def test_the_request_log_shows_the_believed_client(autojump_clock, caplog, allow, peer, logged):
    caplog.set_level(logging.INFO, logger="mlx_trio.requests")
    async with server(forwarded_allow_ips=allow) as (http, _):
        response = await http.get(
            "/v1/models", scope_base={"client": (peer, 5)}, headers={"X-Forwarded-For": "203.0.113.9"}
        )
        assert response.status_code == 200
    assert logged_clients(caplog) == [logged]

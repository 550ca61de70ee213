"""What a web page on another site could make a browser send, and the checks that refuse it.

* **Host** (DNS rebinding). A page on `evil.example` can re-point its own name at 127.0.0.1 and
  then read this server's answers as same-origin; its requests still say `Host: evil.example`.
  So a Host is served only when it is an IP literal (a rebinding page's Host is always its own
  name), `localhost` or a `*.localhost` name (browsers resolve those to loopback themselves),
  the `--host` name the server binds, or a name in `--allowed-hosts` (`*` turns the check off).
  Binding 0.0.0.0 or :: changes nothing: names still need `--allowed-hosts`. Refused: 403
  `host_not_allowed`.
* **Origin** (cross-site writes). A state-changing request (any method but GET, HEAD, OPTIONS)
  whose `Origin` is neither the server's own (the Origin's host and port are the `Host` header's)
  nor allowed by `--cors-origin` is refused: 403 `cross_origin_forbidden`. Clients outside a
  browser send no Origin and are not affected.
* **Content-Type** (simple requests). A browser sends `text/plain`, form and multipart bodies
  to another origin without a CORS preflight; `application/json` needs one. So a
  state-changing request whose body is typed as anything but JSON (`application/json`,
  `application/*+json`), or has a body and no type, is refused: 415 `unsupported_media_type`.
  A POST without a body needs no type (`curl -X POST .../admin/cache/flush`).

The functions are pure; api/http/security.py runs them before routing and answers in the route's
API shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import SplitResult, urlsplit

from api.errors import ApiError
from api.http.forwarded import ip_of
from model.options.values import parse_hosts

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443}


def served_hosts(bind_host: str, allowed: Iterable[str]) -> tuple[str, ...]:
    """The names a Host header may carry besides IP literals and localhost: `--allowed-hosts`
    and the `--host` the server binds when that is a name."""
    names = list(parse_hosts(list(allowed)))
    bind = bind_host.strip().lower().rstrip(".")
    if bind and ip_of(bind) is None and bind not in names:  # (0.0.0.0, ::: IP literals pass anyway)
        names.append(bind)
    return tuple(names)


def _split_host(host: str) -> SplitResult | None:
    """`name`, `name:port`, `1.2.3.4:port`, `[v6]:port` as (hostname, port); None when malformed."""
    try:
        parts = urlsplit("//" + host.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return None
    if not parts.hostname or parts.path or parts.query or parts.fragment or parts.username is not None:
        return None
    return parts


def host_allowed(host: str | None, served: tuple[str, ...]) -> bool:
    if host is None or "*" in served:  # no Host at all: HTTP/1.0, never a browser
        return True
    parts = _split_host(host)
    if parts is None or parts.hostname is None:
        return False
    name = parts.hostname.rstrip(".")
    if ip_of(name) is not None or name == "localhost" or name.endswith(".localhost"):
        return True
    return name in served


def host_refusal(host: str | None, served: tuple[str, ...]) -> ApiError | None:
    if host_allowed(host, served):
        return None
    message = (
        f"Host {host!r} is not served here: start the server with --allowed-hosts NAME to serve it "
        "under that name (a guard against DNS rebinding)"
    )
    return ApiError(403, message, type="permission_error", code="host_not_allowed")


def same_origin(origin: str, host: str | None) -> bool:
    """Whether a browser's `Origin` names this server, as reached through `host`."""
    if host is None:
        return False
    try:
        seen = urlsplit(origin.strip())
        seen_port = seen.port
    except ValueError:
        return False
    own = _split_host(host)
    if own is None or seen.scheme not in DEFAULT_PORTS or not seen.hostname:
        return False
    if seen.hostname.rstrip(".") != (own.hostname or "").rstrip("."):
        return False
    if own.port is None:  # a Host without a port is the default one of the scheme in use
        return seen_port is None or seen_port == DEFAULT_PORTS[seen.scheme]
    return (seen_port or DEFAULT_PORTS[seen.scheme]) == own.port


def origin_refusal(
    method: str, origin: str | None, host: str | None, cors_allows: Callable[[str], bool]
) -> ApiError | None:
    if method.upper() in SAFE_METHODS or not origin:
        return None
    if cors_allows(origin) or same_origin(origin, host):
        return None
    message = f"cross-origin {method.upper()} from {origin!r} refused: allow that origin with --cors-origin"
    return ApiError(403, message, type="permission_error", code="cross_origin_forbidden")


def is_json_type(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def content_type_refusal(method: str, content_type: str | None, has_body: bool) -> ApiError | None:
    if method.upper() in SAFE_METHODS:
        return None
    if content_type is None or not content_type.strip():
        if not has_body:
            return None
        message = "a request body must be sent with Content-Type: application/json"
    elif is_json_type(content_type):
        return None
    else:
        message = f"Content-Type {content_type!r} is not accepted: send the body as application/json"
    return ApiError(415, message, code="unsupported_media_type")

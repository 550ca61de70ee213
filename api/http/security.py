"""Who may call what, from where, and how big a body may be: API key, admin gate, cross-site
guards, CORS, body cap.

Route classes (checked before routing, so an unknown path behind a gate answers 401/403 too and
does not reveal which routes exist):

| path                     | rule                                                                |
|--------------------------|---------------------------------------------------------------------|
| `/v1`, `/v1/*`,          | `--api-key` when set: `Authorization: Bearer <key>` or `x-api-key`  |
| `/tokenize`, `/detokenize`, `/apply-template` | (the same)                                     |
| `/admin/*`,              | with `--admin-token`: that token (Bearer or `x-admin-token`) on     |
| `/v1/adapters*`          | every request, loopback included (401). Without one: only a client  |
|                          | connected directly over loopback (a loopback peer, or a unix        |
|                          | socket, whose request carries no proxy header: X-Forwarded-For,     |
|                          | Forwarded, X-Real-IP, ...; api/http/forwarded.py); anyone else 403       |
| `/health`, `/metrics`,   | open, like vLLM's (`--api-key` there guards only /v1): keep them    |
| `/stats`, everything else| off the public network with a firewall if that matters              |

A proxy that adds no forwarding header makes every client look directly connected: behind any
proxy, set `--admin-token` (docs/deploy.md).

Every request, before the rules above: its `Host` must be served (`--allowed-hosts`; a DNS
rebinding guard, 403). A state-changing request (not GET/HEAD/OPTIONS) must not come from a
browser `Origin` that is neither the server's own nor allowed by `--cors-origin` (403), and its
body must be JSON (415). api/http/cross_site.py has the rules and why.

| flag                     | default                                                            |
|--------------------------|--------------------------------------------------------------------|
| `--api-key`              | none: /v1 open (env `MLX_TRIO_API_KEY`)                            |
| `--admin-token`          | none: admin routes for directly connected loopback clients only   |
|                          | (env `MLX_TRIO_ADMIN_TOKEN`)                                       |
| `--allowed-hosts`        | none: IP literals, localhost, *.localhost and the `--host` name    |
| `--forwarded-allow-ips`  | `127.0.0.1,::1`: whose forwarding headers give the logged client   |
| `--cors-origin`          | none: CORS off                                                     |
| `--max-body-mb`          | 16                                                                 |

Bodies: a `Content-Length` over `--max-body-mb` (MiB, default 16; 0 = no cap) is refused with 413
before a byte is read; a chunked body is cut at the same cap while it is read (Quart's
`MAX_CONTENT_LENGTH`); a body that does not arrive within Quart's `BODY_TIMEOUT` is a 408. All
answer in the route's API error shape. An answer given before its body arrived drains the body or
closes the connection (`api.http.connection`), so the next request on a keep-alive connection is
answered.

CORS is off by default: no `Access-Control-*` header is ever sent, and an `OPTIONS` request is
an ordinary request (gated like any other, then Quart's automatic `Allow` answer).
`--cors-origin` (repeatable, or comma-separated; `*` for any origin) answers preflights with 204
(no credentials needed: browsers send none on a preflight) and adds
`Access-Control-Allow-Origin` to responses for allowed origins. Credentials are never allowed:
the API authenticates with bearer keys, not cookies.

Every refusal is an error in the route's API shape (`api.errors.error_response_for`).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from typing import Protocol

import attrs
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from api.errors import ApiError, error_response_for
from api.http.connection import install_connection_guard
from api.http.cross_site import content_type_refusal, host_refusal, origin_refusal, served_hosts
from api.http.forwarded import PROXY_HEADERS
from api.http.strict_json import StrictJsonRequest
from model.options import AccessOptions, HttpOptions, ServerOptions
from model.options.flags import default_of
from model.options.values import parse_origins

CORS_ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta, openai-beta"
CORS_EXPOSE_HEADERS = "Retry-After, X-Request-Id"
CORS_MAX_AGE_S = 600

Client = tuple[str, int] | None  # ASGI `scope["client"]`
# Outside /v1 but doing work for the caller with the model's tokenizer and template: keyed as /v1.
KEYED_UTILITIES = frozenset({"/tokenize", "/detokenize", "/apply-template"})


class Headers(Protocol):
    """Request headers (quart's, or a plain dict in tests)."""

    def get(self, key: str, /) -> str | None: ...


@attrs.frozen
class SecurityOptions:
    api_key: str | None = None
    admin_token: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int | None = int(default_of(HttpOptions, "max_body_mb") * 2**20)  # None: no cap
    # Host names served besides IP literals and localhost (api/http/cross_site.py); "*" = any.
    served_hosts: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, http: HttpOptions, access: AccessOptions) -> SecurityOptions:
        mb = http.max_body_mb
        return cls(
            api_key=access.api_key or None,
            admin_token=access.admin_token or None,
            cors_origins=parse_origins(access.cors_origins),
            max_body_bytes=int(mb * 2**20) if mb else None,
            served_hosts=served_hosts(http.host, access.allowed_hosts),
        )

    @property
    def cors(self) -> bool:
        return bool(self.cors_origins)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin.rstrip("/") in self.cors_origins


def route_class(path: str) -> str:
    """`api` (/v1*, the keyed utilities), `admin` (/admin/*, and /v1/adapters*: mounting is an operator's act),
    `health`, or `open` for everything else."""
    if path == "/v1/adapters" or path.startswith("/v1/adapters/"):
        return "admin"
    if path == "/v1" or path.startswith("/v1/") or path in KEYED_UTILITIES:
        return "api"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    if path == "/health":
        return "health"
    return "open"


def is_loopback(client: Client) -> bool:
    """ASGI `scope["client"]`: None (a unix socket, an in-process test client) counts as local."""
    if not client:
        return True
    try:
        address = ipaddress.ip_address(str(client[0]).split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def directly_local(client: Client, headers: Headers) -> bool:
    """A loopback peer (or a unix socket) whose request carries no proxy's forwarding header."""
    return is_loopback(client) and not any(headers.get(name) for name in PROXY_HEADERS)


def cross_site_refusal(options: SecurityOptions, *, method: str, headers: Headers, has_body: bool) -> ApiError | None:
    """The Origin and Content-Type guards of a state-changing request (api/http/cross_site.py)."""
    host = headers.get("Host")
    refusal = origin_refusal(method, headers.get("Origin"), host, options.origin_allowed)
    return refusal or content_type_refusal(method, headers.get("Content-Type"), has_body)


def presented_credentials(headers: Headers, *extra_headers: str) -> list[str]:
    """Bearer token and the named key headers, as sent (several may be present)."""
    found = []
    authorization = headers.get("Authorization") or ""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        found.append(token.strip())
    for name in extra_headers:
        value = headers.get(name)
        if value:
            found.append(value.strip())
    return found


def credential_matches(presented: Iterable[str], secret: str) -> bool:
    expected = secret.encode()
    # Every candidate is compared (constant time each), so timing says nothing about which.
    results = [hmac.compare_digest(candidate.encode(), expected) for candidate in presented]
    return any(results)


def check_access(options: SecurityOptions, *, path: str, headers: Headers, client: Client) -> ApiError | None:
    """The refusal for this request, or None when it may proceed (pure, for tests)."""
    kind = route_class(path)
    if kind == "api" and options.api_key is not None:
        if not credential_matches(presented_credentials(headers, "x-api-key"), options.api_key):
            return ApiError(
                401,
                "invalid or missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
    elif kind == "admin" and options.admin_token is not None:
        # The token is the only admin credential once it is set: a same-host proxy makes every
        # client a loopback peer, so the peer's address proves nothing.
        if not credential_matches(presented_credentials(headers, "x-admin-token"), options.admin_token):
            return ApiError(
                401,
                "invalid or missing admin token: send it as 'Authorization: Bearer <token>' or "
                "'x-admin-token: <token>'",
                code="invalid_admin_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
    elif kind == "admin" and not directly_local(client, headers):
        return ApiError(
            403,
            "admin routes are served only to clients connected directly over loopback (not through a "
            "proxy) unless the server is started with --admin-token",
            type="permission_error",
            code="admin_forbidden",
        )
    return None


def body_too_large(options: SecurityOptions, content_length: int | None) -> ApiError | None:
    cap = options.max_body_bytes
    if cap is None or content_length is None or content_length <= cap:
        return None
    return _too_large(f"request body is {content_length} bytes", cap)


def _too_large(what: str, cap: int | None) -> ApiError:
    return ApiError(413, f"{what}; this server accepts at most {cap} bytes (--max-body-mb)", code="request_too_large")


def install_security(app: QuartTrio, options: SecurityOptions | ServerOptions) -> SecurityOptions:
    """Register the gate (before_request) and CORS headers (after_request) on `app`.

    `options` is a `SecurityOptions` or the server's options (read with
    `SecurityOptions.from_options`). Call it before other before_request hooks are registered so
    refusals come first.
    """
    if not isinstance(options, SecurityOptions):
        options = SecurityOptions.from_options(options.http, options.access)
    app.config["MAX_CONTENT_LENGTH"] = options.max_body_bytes
    app.request_class = StrictJsonRequest  # hostile bytes are a 400, never a 500
    install_connection_guard(app)  # an early answer drains or closes; keep-alive ends on time

    @app.before_request
    async def security_gate() -> Response | None:
        path = request.path
        refusal = host_refusal(request.headers.get("Host"), options.served_hosts)
        if refusal is not None:  # first: a rebinding page learns nothing, not even CORS answers
            return error_response_for(path, refusal)
        if request.method == "OPTIONS" and options.cors and request.headers.get("Access-Control-Request-Method"):
            return _preflight(options, path)
        refusal = check_access(options, path=path, headers=request.headers, client=request.scope.get("client"))
        if refusal is None:
            refusal = cross_site_refusal(options, method=request.method, headers=request.headers, has_body=_has_body())
        if refusal is None:
            refusal = body_too_large(options, request.content_length)
        return None if refusal is None else error_response_for(path, refusal)

    @app.errorhandler(RequestEntityTooLarge)
    async def body_cut(error: RequestEntityTooLarge) -> Response:
        # A body without Content-Length (chunked) that outgrew the cap while it was read.
        return error_response_for(request.path, _too_large("request body is larger", options.max_body_bytes))

    @app.errorhandler(RequestTimeout)
    async def body_timed_out(error: RequestTimeout) -> Response:
        # Quart's BODY_TIMEOUT ran out while the route read the body (api/http/connection.py then
        # closes the connection instead of waiting for the rest).
        seconds = app.config["BODY_TIMEOUT"]
        message = f"the request body did not arrive within {seconds} s"
        return error_response_for(request.path, ApiError(408, message, code="request_timeout"))

    @app.after_request
    async def cors_headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if options.cors and origin and options.origin_allowed(origin) and request.method != "OPTIONS":
            _allow_origin(options, response, origin)
        return response

    return options


def _has_body() -> bool:
    length = request.content_length
    return bool(length) or "chunked" in (request.headers.get("Transfer-Encoding") or "").lower()


def _preflight(options: SecurityOptions, path: str) -> Response:
    """A CORS preflight (OPTIONS + Access-Control-Request-Method): answered here, before any
    auth, since browsers never send credentials on one."""
    origin = request.headers.get("Origin") or ""
    if not options.origin_allowed(origin):
        return error_response_for(
            path,
            ApiError(403, f"CORS origin {origin!r} is not allowed", type="permission_error", code="cors_forbidden"),
        )
    response = Response(b"", status=204)
    _allow_origin(options, response, origin)
    response.headers["Access-Control-Allow-Methods"] = CORS_ALLOW_METHODS
    response.headers["Access-Control-Allow-Headers"] = (
        request.headers.get("Access-Control-Request-Headers") or CORS_DEFAULT_HEADERS
    )
    response.headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
    return response


def _allow_origin(options: SecurityOptions, response: Response, origin: str) -> None:
    response.headers["Access-Control-Allow-Origin"] = "*" if "*" in options.cors_origins else origin
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE_HEADERS
    if "*" not in options.cors_origins:
        response.headers.add("Vary", "Origin")

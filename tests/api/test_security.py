"""Auth, admin gate, Host / Origin / Content-Type guards, body cap, CORS and /health's 503, for every route
class, on a FakeWorker."""

from __future__ import annotations

import json

import pytest

from actors.options import options as serve_options
from actors.shutdown import ShutdownPlan
from api.http.cross_site import content_type_refusal, host_allowed, same_origin, served_hosts
from api.http.security import SecurityOptions, check_access, is_loopback, presented_credentials
from model.options.values import parse_hosts, parse_origins
from tests.fakes import FakeWorker
from tests.helpers.options import parsed
from tests.helpers.security_server import server

KEY = "sk-test-key"
ADMIN = "admin-secret"
REMOTE = {"client": ("203.0.113.9", 40000)}
CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES_BODY = {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES_BODY = {"input": "hi", "max_output_tokens": 2}


async def openai_error(response) -> dict:
    body = await response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


async def anthropic_error(response) -> dict:
    body = await response.get_json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


# --- pure pieces -----------------------------------------------------------------------------


def test_loopback_detection():
    assert is_loopback(("127.0.0.1", 1)) and is_loopback(("127.3.4.5", 1))
    assert is_loopback(("::1", 1)) and is_loopback(("::ffff:127.0.0.1", 1))
    assert is_loopback(None)  # a unix socket or an in-process client
    assert not is_loopback(("10.0.0.1", 1)) and not is_loopback(("::ffff:10.0.0.1", 1))
    assert not is_loopback(("2001:db8::1", 1)) and not is_loopback(("not-an-ip", 1))


def test_origin_parsing():
    assert parse_origins(["https://a.example/, https://b.example", "https://a.example"]) == (
        "https://a.example",
        "https://b.example",
    )
    assert parse_origins("*") == ("*",) and parse_origins([]) == ()


def test_credentials_from_both_headers():
    headers = {"Authorization": "bearer  tok ", "x-api-key": "k2"}
    assert presented_credentials(headers, "x-api-key") == ["tok", "k2"]
    assert presented_credentials({"Authorization": "Basic abc"}, "x-api-key") == []
    options = SecurityOptions(api_key=KEY)
    assert check_access(options, path="/v1x", headers={}, client=None) is None  # not under /v1/
    assert check_access(options, path="/v1", headers={}, client=None).status == 401


def test_options_from_config():
    def security(**fields):
        options = serve_options(**fields)
        return SecurityOptions.from_options(options.http, options.access)

    options = security(max_body_mb=0, cors_origins=("https://x/",))
    assert options.max_body_bytes is None and options.cors_origins == ("https://x",)
    assert security().max_body_bytes == 16 * 2**20
    assert security(api_key="", admin_token="") == SecurityOptions()  # empty: none


# --- /v1/* and the API key -------------------------------------------------------------------


async def test_without_a_key_configured_everything_is_open(autojump_clock):
    async with server() as (client, _):
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT_BODY)).status_code == 200


async def test_api_key_guards_every_v1_route_in_its_api_shape(autojump_clock):
    async with server(api_key=KEY) as (client, _):
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/fake-model", None),
            ("POST", "/v1/chat/completions", CHAT_BODY),
            ("POST", "/v1/completions", {"prompt": "x"}),
            ("POST", "/v1/responses", RESPONSES_BODY),
            ("GET", "/v1/no-such-route", None),  # refused before routing: nothing is revealed
        ]:
            response = await client.open(path, method=method, json=body)
            assert response.status_code == 401, path
            assert response.headers["WWW-Authenticate"] == "Bearer"
            error = await openai_error(response)
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = await client.post(path, json=MESSAGES_BODY)
            assert response.status_code == 401
            assert (await anthropic_error(response))["type"] == "authentication_error"


async def test_api_key_accepted_as_bearer_or_x_api_key(autojump_clock):
    async with server(api_key=KEY) as (client, _):
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"authorization": f"bearer {KEY}"}):
            assert (await client.get("/v1/models", headers=headers)).status_code == 200
            response = await client.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
            assert response.status_code == 200
            assert (await client.post("/v1/messages", json=MESSAGES_BODY, headers=headers)).status_code == 200
        for headers in (
            {"Authorization": "Bearer wrong"},
            {"x-api-key": KEY + "x"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": KEY},
        ):
            assert (await client.get("/v1/models", headers=headers)).status_code == 401, headers


async def test_open_routes_stay_open_with_a_key(autojump_clock):
    async with server(api_key=KEY, admin_token=ADMIN) as (client, _):
        health = await client.get("/health", scope_base=REMOTE)
        assert health.status_code == 200 and await health.get_data() == b'{"status": "ok"}'
        assert (await client.get("/metrics", scope_base=REMOTE)).status_code == 200
        assert (await client.get("/stats", scope_base=REMOTE)).status_code == 200


# --- /admin/* --------------------------------------------------------------------------------


async def test_admin_routes_are_loopback_only_by_default(autojump_clock):
    async with server(api_key=KEY) as (client, _):
        remote = await client.post("/admin/cache/flush", scope_base=REMOTE)
        assert remote.status_code == 403
        assert (await openai_error(remote))["code"] == "admin_forbidden"
        # The API key is not an admin credential.
        keyed = await client.post("/admin/cache/flush", scope_base=REMOTE, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 403
        for client_addr in (("127.0.0.1", 5), ("::1", 5), None):
            local = await client.post("/admin/no-such-route", scope_base={"client": client_addr})
            assert local.status_code == 404  # through the gate, then an ordinary unknown path


async def test_without_a_token_a_proxied_loopback_request_is_not_local(autojump_clock):
    # A same-host proxy connects over loopback; its forwarding headers say the client is elsewhere.
    async with server() as (client, _):
        for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP", "X-Forwarded-Proto", "Via"):
            for client_addr in (("127.0.0.1", 5), None):
                response = await client.post(
                    "/admin/cache/flush", scope_base={"client": client_addr}, headers={header: "for=198.51.100.4"}
                )
                assert response.status_code == 403, header
                assert (await openai_error(response))["code"] == "admin_forbidden"
        assert (await client.post("/admin/cache/flush", scope_base={"client": ("127.0.0.1", 5)})).status_code == 200


async def test_with_a_token_loopback_clients_need_it_too(autojump_clock):
    async with server(admin_token=ADMIN) as (client, _):
        for client_addr in (("127.0.0.1", 5), ("::1", 5), None):
            for method, path in (("POST", "/admin/cache/flush"), ("GET", "/v1/adapters"), ("DELETE", "/v1/adapters/a")):
                response = await client.open(path, method=method, scope_base={"client": client_addr})
                assert response.status_code == 401, (client_addr, path)
                assert (await openai_error(response))["code"] == "invalid_admin_token"
            local = await client.post(
                "/admin/cache/flush", scope_base={"client": client_addr}, headers={"x-admin-token": ADMIN}
            )
            assert local.status_code == 200


async def test_admin_token_lets_remote_clients_in(autojump_clock):
    async with server(admin_token=ADMIN) as (client, _):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"x-admin-token": "nope"}):
            response = await client.post("/admin/no-such-route", scope_base=REMOTE, headers=headers)
            assert response.status_code == 401
            assert (await openai_error(response))["code"] == "invalid_admin_token"
        for headers in ({"Authorization": f"Bearer {ADMIN}"}, {"x-admin-token": ADMIN}):
            response = await client.post("/admin/no-such-route", scope_base=REMOTE, headers=headers)
            assert response.status_code == 404
        # The admin token opens /admin only, not /v1 (which has no key here, so it is open anyway).
        assert (await client.get("/v1/models", scope_base=REMOTE)).status_code == 200


# --- body cap --------------------------------------------------------------------------------

CAP_MB = 1 / 1024  # 1 KiB


async def test_body_over_the_cap_is_413_in_each_api_shape(autojump_clock):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 2}).encode()
    # Refused on its Content-Length, before a byte is read (the test client sends none by itself).
    sized = {"Content-Type": "application/json", "Content-Length": str(len(big))}
    async with server(max_body_mb=CAP_MB) as (client, _):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/admin/cache/flush", "/nope"):
            response = await client.post(path, data=big, headers=sized)
            assert response.status_code == 413, path
            error = await openai_error(response)
            assert error["code"] == "request_too_large" and "1024 bytes" in error["message"]
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = await client.post(path, data=big, headers=sized)
            assert response.status_code == 413
            assert (await anthropic_error(response))["type"] == "request_too_large"
        small = await client.post("/v1/chat/completions", json=CHAT_BODY)
        assert small.status_code == 200


async def test_auth_is_checked_before_the_body_cap(autojump_clock):
    async with server(max_body_mb=CAP_MB, api_key=KEY) as (client, _):
        response = await client.post("/v1/chat/completions", data=b"x" * 5000, headers={"Content-Length": "5000"})
        assert response.status_code == 401


async def test_chunked_body_over_the_cap_is_cut_while_read(autojump_clock):
    async with server(max_body_mb=CAP_MB) as (client, _):
        for path, shape in (("/v1/chat/completions", openai_error), ("/v1/messages", anthropic_error)):
            async with client.request(path, method="POST", headers={"Content-Type": "application/json"}) as conn:
                for _ in range(4):
                    await conn.send(b" " * 512)  # no Content-Length: the cap applies as it arrives
                await conn.send_complete()
                response = await conn.as_response()
            assert response.status_code == 413, path
            assert "larger" in (await shape(response))["message"]


async def test_zero_means_no_cap(autojump_clock):
    async with server(max_body_mb=0) as (client, _):
        response = await client.post("/v1/completions", data=b"{" + b" " * (17 * 2**20))
        assert response.status_code == 400  # read in full (past Quart's 16 MiB default), then bad JSON


# --- CORS ------------------------------------------------------------------------------------

ORIGIN = "https://app.example"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_cors_is_off_by_default(autojump_clock):
    async with server() as (client, _):
        response = await client.get("/v1/models", headers={"Origin": ORIGIN})
        assert response.status_code == 200
        assert not [k for k, _ in response.headers.items() if k.lower().startswith("access-control-")]
        preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code != 204
        assert "Access-Control-Allow-Origin" not in preflight.headers


async def test_cors_preflight_and_responses_for_an_allowed_origin(autojump_clock):
    async with server(cors_origins=(ORIGIN,), api_key=KEY) as (client, _):
        preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)  # no key: preflights carry none
        assert preflight.status_code == 204
        assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
        assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "Origin" in preflight.headers.get_all("Vary")
        assert "Access-Control-Allow-Credentials" not in preflight.headers
        ok = await client.get("/v1/models", headers={"Origin": ORIGIN, "x-api-key": KEY})
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "Retry-After" in ok.headers["Access-Control-Expose-Headers"]
        refused = await client.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # and the browser may read why
        assert refused.headers["Access-Control-Allow-Origin"] == ORIGIN


async def test_cors_refuses_other_origins(autojump_clock):
    async with server(cors_origins=(ORIGIN,)) as (client, _):
        preflight = await client.options("/v1/messages", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert preflight.status_code == 403
        assert (await anthropic_error(preflight))["type"] == "permission_error"
        assert "Access-Control-Allow-Origin" not in preflight.headers
        response = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert response.status_code == 200 and "Access-Control-Allow-Origin" not in response.headers


async def test_cors_wildcard(autojump_clock):
    async with server(cors_origins=("*",)) as (client, _):
        preflight = await client.options("/v1/responses", headers={**PREFLIGHT, "Origin": "https://any.example"})
        assert preflight.status_code == 204 and preflight.headers["Access-Control-Allow-Origin"] == "*"
        response = await client.post("/v1/chat/completions", json=CHAT_BODY, headers={"Origin": "https://x.example"})
        assert response.headers["Access-Control-Allow-Origin"] == "*"


# --- Host, Origin, Content-Type (api/http/cross_site.py) -------------------------------------------


def test_host_rules():
    for host in ("localhost", "localhost:8080", "LOCALHOST.", "app.localhost:1", "127.0.0.1:8080", "[::1]:8080"):
        assert host_allowed(host, ()), host
    assert host_allowed("10.1.2.3:8080", ()) and host_allowed("[2001:db8::5]", ())  # a rebinding Host is a name
    assert host_allowed(None, ())  # HTTP/1.0: no browser
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "", "a b", "x:notaport", "u@localhost"):
        assert not host_allowed(host, ()), host
    assert host_allowed("Chat.Example:443", ("chat.example",)) and not host_allowed("x.chat.example", ("chat.example",))
    assert host_allowed("anything.example", ("*",))
    assert served_hosts("0.0.0.0", ["a.example,B.example."]) == ("a.example", "b.example")
    assert served_hosts("myhost.lan", []) == ("myhost.lan",) and served_hosts("10.0.0.2", []) == ()
    options = serve_options(host="box.lan", allowed_hosts=("a.example",))
    assert SecurityOptions.from_options(options.http, options.access).served_hosts == (
        "a.example",
        "box.lan",
    )
    with pytest.raises(ValueError, match="without scheme or port"):
        parse_hosts(["http://a.example"])
    with pytest.raises(ValueError):
        parse_hosts("a.example:8080")


def test_same_origin_rules():
    assert same_origin("http://localhost:8080", "localhost:8080")
    assert same_origin("https://chat.example", "chat.example")  # a TLS proxy passing Host on
    assert same_origin("http://chat.example", "chat.example:80") and same_origin("https://[::1]:9", "[::1]:9")
    assert not same_origin("http://localhost:8081", "localhost:8080")
    assert not same_origin("https://chat.example:8443", "chat.example")
    assert not same_origin("http://evil.example:8080", "localhost:8080")
    assert not same_origin("null", "localhost") and not same_origin("file://", "localhost")
    assert not same_origin("http://localhost:99999", "localhost:99999") and not same_origin("http://localhost", None)


def test_json_types():
    for content_type in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.x+json"):
        assert content_type_refusal("POST", content_type, True) is None
    for content_type in (
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ):
        assert content_type_refusal("POST", content_type, False).status == 415, content_type
    assert content_type_refusal("POST", None, True).status == 415  # a body with no type: a fetch of a Blob
    assert content_type_refusal("POST", None, False) is None  # curl -X POST, nothing to parse
    assert content_type_refusal("GET", "text/plain", True) is None


async def test_a_foreign_host_is_refused_on_every_route(autojump_clock):
    async with server(admin_token=ADMIN) as (client, _):
        for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("GET", "/"), ("POST", "/admin/cache/flush")):
            response = await client.open(
                path, method=method, headers={"Host": "evil.example:8080", "x-admin-token": ADMIN}
            )
            assert response.status_code == 403, path
            error = await openai_error(response)
            assert error["code"] == "host_not_allowed" and "--allowed-hosts" in error["message"]
        response = await client.post("/v1/messages", json=MESSAGES_BODY, headers={"Host": "evil.example"})
        assert response.status_code == 403 and (await anthropic_error(response))["type"] == "permission_error"
        for host in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "192.0.2.7"):
            assert (await client.get("/v1/models", headers={"Host": host})).status_code == 200, host
    async with server(allowed_hosts=("chat.example",), cors_origins=("*",)) as (client, _):
        assert (await client.get("/v1/models", headers={"Host": "chat.example"})).status_code == 200
        assert (await client.get("/v1/models", headers={"Host": "evil.example"})).status_code == 403
        preflight = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "Host": "evil.example"})
        assert preflight.status_code == 403 and "Access-Control-Allow-Origin" not in preflight.headers


async def test_a_cross_origin_write_is_refused_unless_cors_allows_it(autojump_clock):
    evil = {"Origin": "https://evil.example"}
    async with server() as (client, _):
        for path, body, shape in (
            ("/v1/chat/completions", CHAT_BODY, openai_error),
            ("/v1/adapters", {"id": "a", "path": "/p"}, openai_error),
            ("/admin/cache/flush", None, openai_error),
            ("/v1/messages", MESSAGES_BODY, anthropic_error),
        ):
            response = await client.post(path, json=body, headers=evil)
            assert response.status_code == 403, path
            error = await shape(response)
            assert "cross-origin POST" in error["message"] and "--cors-origin" in error["message"]
        assert (await client.delete("/v1/adapters/a", headers=evil)).status_code == 403
        assert (await client.get("/v1/models", headers=evil)).status_code == 200  # a read: the browser hides it
        # The chat page's own requests: same origin as the Host they were sent to.
        same = {"Origin": "http://localhost"}
        assert (await client.post("/v1/chat/completions", json=CHAT_BODY, headers=same)).status_code == 200
    async with server(cors_origins=("https://evil.example",)) as (client, _):
        assert (await client.post("/v1/chat/completions", json=CHAT_BODY, headers=evil)).status_code == 200


async def test_a_body_that_is_not_json_is_415_in_each_api_shape(autojump_clock):
    async with server() as (client, _):
        for path, shape in (
            ("/v1/chat/completions", openai_error),
            ("/v1/adapters", openai_error),
            ("/v1/responses", openai_error),
            ("/v1/messages", anthropic_error),
        ):
            for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
                data = json.dumps(CHAT_BODY).encode()
                headers = {"Content-Length": str(len(data))}  # (the test client sends none by itself)
                if content_type:
                    headers["Content-Type"] = content_type
                response = await client.post(path, data=data, headers=headers)
                assert response.status_code == 415, (path, content_type)
                error = await shape(response)
                assert "application/json" in error["message"]
        response = await client.post("/v1/chat/completions", json=CHAT_BODY)
        assert response.status_code == 200
        typed = {"Content-Type": "application/json; charset=utf-8"}
        assert (await client.post("/v1/chat/completions", data=json.dumps(CHAT_BODY), headers=typed)).status_code == 200
        assert (await client.post("/admin/cache/flush")).status_code == 200  # no body: no type needed


# --- /health ---------------------------------------------------------------------------------


class MortalWorker(FakeWorker):
    alive = True


async def test_health_is_503_with_a_reason_when_the_worker_is_dead(autojump_clock):
    worker = MortalWorker()
    async with server(worker) as (client, handles):
        assert (await client.get("/health")).status_code == 200
        worker.alive = False
        response = await client.get("/health")
        assert response.status_code == 503
        assert await response.get_json() == {"status": "unavailable", "reason": "gpu worker is not running"}
        metrics = (await (await client.get("/metrics")).get_data()).decode()
        assert "mlx_trio:engine_healthy 0.0" in metrics


async def test_health_is_503_while_draining_and_without_a_model(autojump_clock):
    async with server() as (client, handles):
        handles.admission.close(cutoff_after=30)
        response = await client.get("/health")
        assert response.status_code == 503 and (await response.get_json())["reason"] == "shutting down"
    async with server() as (client, handles):
        handles.info = None
        assert (await (await client.get("/health")).get_json())["reason"] == "model not loaded"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_refusal_bodies_are_json(autojump_clock, path):
    async with server(api_key=KEY) as (client, _):
        response = await client.post(path, data=b"not json")
        assert response.status_code == 401 and response.content_type == "application/json"
        json.loads(await response.get_data())


# --- hostile bodies (api/http/strict_json.py) ----------------------------------------------------

HOSTILE = [
    b"\xff\xfe{}",  # not UTF-8
    b"[" * 100_000,  # nested past the recursion limit
    b'{"prompt": "x", "max_tokens": NaN}',  # not JSON
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "temperature": 1e400}',  # grammar-valid, but infinite
    b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\udfff"}]}',  # lone surrogates
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int-digits limit
]


async def test_hostile_bodies_are_400_in_each_api_shape(autojump_clock):
    async with server() as (client, _):
        for data in HOSTILE:
            for path, shape in (
                ("/v1/chat/completions", openai_error),
                ("/v1/completions", openai_error),
                ("/v1/responses", openai_error),
                ("/v1/messages", anthropic_error),
            ):
                response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
                assert response.status_code == 400, (path, data[:40])
                await shape(response)
        ok = await client.post("/v1/completions", json={"prompt": "\U0001f600 ok", "max_tokens": 1})
        assert ok.status_code == 200  # a real astral character (a valid surrogate pair) is fine


# --- flags and the hypercorn config ----------------------------------------------------------


def test_flags_and_environment(monkeypatch):

    args = parsed([])
    assert (
        args.api_key,
        args.admin_token,
        args.cors_origins,
        args.max_body_mb,
        args.log_prompts,
        args.idle_timeout,
    ) == (None, None, (), 16.0, False, 5.0)
    monkeypatch.setenv("MLX_TRIO_API_KEY", "from-env")
    monkeypatch.setenv("MLX_TRIO_ADMIN_TOKEN", "admin-env")
    args = parsed(
        [
            "--cors-origin",
            "https://a,https://b",
            "--cors-origin",
            "*",
            "--max-body-mb",
            "0",
            "--log-prompts",
            "--idle-timeout",
            "30",
        ]
    )
    assert args.api_key == "from-env" and args.admin_token == "admin-env"
    assert parse_origins(args.cors_origins) == ("https://a", "https://b", "*")
    assert args.max_body_mb == 0 and args.log_prompts and args.idle_timeout == 30
    assert parsed(["--api-key", "flag"]).api_key == "flag"  # the flag wins


def test_proxy_flags(capsys):

    config = parsed([])
    assert config.allowed_hosts == () and config.forwarded_allow_ips == ("127.0.0.1", "::1")
    args = [
        "--allowed-hosts",
        "Chat.Example.,api.example",
        "--allowed-hosts",
        "chat.example",
        "--forwarded-allow-ips",
        "10.0.0.0/8, 192.168.1.1",
        "--forwarded-allow-ips",
        "fd00::/8",
    ]
    config = parsed(args)
    assert config.allowed_hosts == ("chat.example", "api.example")
    assert config.forwarded_allow_ips == ("10.0.0.0/8", "192.168.1.1/32", "fd00::/8")  # the default replaced
    assert parsed(["--forwarded-allow-ips", ""]).forwarded_allow_ips == ()
    assert parsed(["--forwarded-allow-ips", "*"]).forwarded_allow_ips == ("*",)
    for bad in (["--forwarded-allow-ips", "proxy.lan"], ["--allowed-hosts", "https://chat.example"]):
        with pytest.raises(SystemExit) as exited:
            parsed(bad)
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "'proxy.lan' is not an IP address" in err and "without scheme or port" in err


async def test_serve_http_sets_the_idle_timeout_and_no_read_timeout(monkeypatch):
    from actors import serve

    seen = {}

    async def fake_serve(app, config, *, shutdown_trigger):
        seen["config"] = config

    monkeypatch.setattr("hypercorn.trio.serve", fake_serve)
    config = serve_options(idle_timeout=7.5, port=0, shutdown_timeout=3.0)
    await serve._serve_http(config, ShutdownPlan.for_options(config), None, None)
    config = seen["config"]
    assert config.keep_alive_timeout == 7.5
    assert config.read_timeout is None  # a silent streaming client must not be cut
    assert config.accesslog is None  # api/observability/request_log.py is the access log
    assert config.graceful_timeout == 5.0  # the plan's HTTP deadline: 3 s of drain + 2 s of grace

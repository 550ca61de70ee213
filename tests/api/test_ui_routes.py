"""The chat page's routes (api/ui_routes.py) on a FakeWorker: content types, caching, --no-ui,
the page open without the API key while /v1/* still needs it, and the files shipped as package
data. The page itself is driven in a real browser by tests/e2e/test_web_ui_browser.py."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from actors.options import options as serve_options
from actors.root import start_actors
from api.app import create_app
from api.ui_routes import ASSETS, STATIC_DIR
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.options import parsed

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-ui-test"
REMOTE = {"client": ("203.0.113.9", 40000)}


@asynccontextmanager
async def server(**config):
    worker = FakeWorker(prefill_cost=0.1, join_cost=0.1, step_cost=0.1)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(
            nursery, worker, options=serve_options(**config), make_tokenizer=lambda info: FakeTokenizer()
        )
        yield create_app(handles).test_client()
        nursery.cancel_scope.cancel()


async def test_the_page_and_its_assets_have_their_content_types(autojump_clock):
    async with server() as client:
        page = await client.get("/")
        assert page.status_code == 200
        assert page.headers["Content-Type"] == "text/html; charset=utf-8"
        assert page.headers["Cache-Control"] == "no-cache"
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        html = (await page.get_data()).decode()
        assert 'src="ui/app.js"' in html and 'src="ui/markdown.js"' in html and 'href="ui/app.css"' in html
        for name, content_type in [
            ("app.js", "text/javascript"),
            ("markdown.js", "text/javascript"),
            ("app.css", "text/css"),
        ]:
            response = await client.get(f"/ui/{name}")
            assert response.status_code == 200, name
            assert response.headers["Content-Type"] == f"{content_type}; charset=utf-8"
            assert response.headers["Cache-Control"] == "no-cache"
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            assert await response.get_data() == (STATIC_DIR / name).read_bytes()


async def test_an_unchanged_asset_revalidates_with_304(autojump_clock):
    async with server() as client:
        first = await client.get("/ui/app.js")
        again = await client.get("/ui/app.js", headers={"If-None-Match": first.headers["ETag"]})
        assert again.status_code == 304 and await again.get_data() == b""
        changed = await client.get("/ui/app.js", headers={"If-None-Match": '"stale"'})
        assert changed.status_code == 200 and await changed.get_data() == await first.get_data()


async def test_unknown_assets_are_json_404s_and_no_path_reaches_the_disk(autojump_clock):
    async with server() as client:
        for path in ("/ui/missing.js", "/ui/..%2Fui_routes.py", "/ui/../app.py", "/ui/"):
            response = await client.get(path)
            assert response.status_code == 404, path
            assert (await response.get_json())["error"]["code"] == "not_found", path


async def test_no_ui_turns_the_page_back_into_404(autojump_clock):
    async with server(ui=False) as client:
        for path in ("/", "/ui/app.js", "/ui/markdown.js", "/ui/app.css"):
            response = await client.get(path)
            assert response.status_code == 404, path
            assert (await response.get_json())["error"]["code"] == "not_found"
        assert (await client.get("/v1/models")).status_code == 200  # the API is unchanged


def test_the_no_ui_flag_fills_serve_config():
    assert parsed([]).ui is True
    assert parsed(["--no-ui"]).ui is False


async def test_with_an_api_key_the_page_is_open_and_the_api_is_not(autojump_clock):
    async with server(api_key=KEY) as client:
        for path in ("/", "/ui/app.js", "/ui/app.css"):
            assert (await client.get(path, scope_base=REMOTE)).status_code == 200, path
        assert (await client.get("/v1/models", scope_base=REMOTE)).status_code == 401
        refused = await client.post("/v1/chat/completions", json={"messages": []}, scope_base=REMOTE)
        assert refused.status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        assert (await client.get("/v1/models", headers=headers, scope_base=REMOTE)).status_code == 200


def test_the_page_loads_nothing_from_elsewhere():
    """Offline: no CDN, font or absolute URL in the shipped files."""
    for name in ASSETS:
        text = (STATIC_DIR / name).read_text(encoding="utf-8")
        assert not re.search(r"https?://", text), name
        assert "@import" not in text and "url(" not in text, name


def test_the_assets_are_package_data():
    """`pip install .` ships api/static/*: every served file matches the package-data globs."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = config["tool"]["setuptools"]["package-data"]["api"]
    for name in ASSETS:
        assert any(fnmatch.fnmatch(f"static/{name}", pattern) for pattern in globs), name
        assert (STATIC_DIR / name).is_file(), name

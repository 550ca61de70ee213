"""The chat page: `GET /` (index.html) and its assets under `/ui/` (api/static/, package data).

The page is plain HTML, CSS and JavaScript with no build step and no external resource, so it
works offline. It talks to the server's own /v1 API; with `--api-key` set it asks the user for
the key and sends it as a Bearer token, which is why `/` and `/ui/*` themselves stay open
(api/http/security.py: they are neither /v1 nor /admin). `--no-ui` registers nothing here, so `/`
answers 404 like any unknown path.

Assets are read once at start-up and served from memory with an ETag and `Cache-Control:
no-cache`: names carry no content hash, so a browser revalidates (a cheap 304) instead of
keeping a stale script across a server upgrade.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs
from quart import Blueprint, Response, request

from api.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parent / "static"
# name -> content type; only these files are ever served (no path from the URL reaches the disk).
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# Everything the page loads comes from this origin; no inline script or style.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


@attrs.frozen
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(directory: Path = STATIC_DIR) -> dict[str, Asset]:
    """The page's files, read once; a missing one fails start-up rather than the first visit."""
    assets = {}
    for name, content_type in ASSETS.items():
        body = (directory / name).read_bytes()
        assets[name] = Asset(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')
    return assets


def blueprint(enabled: bool = True, directory: Path = STATIC_DIR) -> Blueprint:
    """The page's routes; with `enabled` False (`--no-ui`) an empty blueprint."""
    bp = Blueprint("ui", __name__)
    if not enabled:
        return bp
    assets = load_assets(directory)

    def serve(name: str) -> Response:
        asset = assets[name]
        headers = {"Cache-Control": "no-cache", "ETag": asset.etag, "X-Content-Type-Options": "nosniff"}
        if name == "index.html":
            headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
            headers["Referrer-Policy"] = "no-referrer"
        if asset.etag in request.headers.get("If-None-Match", ""):
            return Response(b"", status=304, headers=headers)
        return Response(asset.body, content_type=asset.content_type, headers=headers)

    @bp.get("/")
    async def index() -> Response:
        return serve("index.html")

    @bp.get("/ui/<name>")
    async def asset(name: str) -> Response:
        if name not in assets:
            raise ApiError(404, "not found", code="not_found")
        return serve(name)

    return bp

"""The small endpoints clients rely on beside generation (docs/api.md "Utilities"):
`POST /tokenize`, `POST /detokenize`, `POST /apply-template` (api/utilities/tokens.py), `GET /v1`
(an index of the server: name, version, model, endpoints) and `GET /fit` (api/utilities/fit.py).

The three POST routes take `--api-key` like /v1 (api/http/security.py); the two GETs are open,
like /stats. Errors are OpenAI's envelope.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

from quart import Blueprint, Response, current_app

from actors.handles import ServerHandles
from api.http import offload
from api.http.wire import json_body, json_response
from api.model_names import check_requested_model, current, model_handles, served_names
from api.utilities import fit, tokens

SERVER_NAME = "mlx-trio-server"


def blueprint(server: ServerHandles) -> Blueprint:
    bp = Blueprint("utilities", __name__)

    async def answer(work: Callable[[ServerHandles, Mapping[str, Any]], dict[str, Any]]) -> Response:
        """Run `work` on the request's model and body off the event loop (it tokenizes)."""
        body = await json_body()
        handles = await model_handles(server)
        check_requested_model(handles, body)
        return json_response(await offload.run(work, handles, body))

    @bp.post("/tokenize")
    async def tokenize() -> Response:
        return await answer(tokens.tokenize)

    @bp.post("/detokenize")
    async def detokenize() -> Response:
        return await answer(tokens.detokenize)

    @bp.post("/apply-template")
    async def apply_template() -> Response:
        return await answer(tokens.apply_template)

    @bp.get("/v1")
    async def index() -> Response:
        return json_response(
            {
                "object": "server",
                "name": SERVER_NAME,
                "version": version(),
                "model": served_names(server)[0],
                "endpoints": endpoints(),
            }
        )

    @bp.get("/fit")
    async def fit_route() -> Response:
        return json_response(await fit.fit(current(server)))

    return bp


def version() -> str:
    try:
        return metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def endpoints() -> list[str]:
    """Every route the app serves as "METHOD /path", sorted by path."""
    routes = set()
    for rule in current_app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            routes.add((rule.rule, method))
    return [f"{method} {path}" for path, method in sorted(routes)]

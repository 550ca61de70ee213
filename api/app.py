"""The quart-trio application factory.

`create_app(handles)` wires the routes to already-running actors; the app starts nothing and
owns nothing (no `before_serving`, no `app.nursery`): the actors live in the root's nursery and
hypercorn is run by the root (actors/root.py), so shutdown order is ours, not the framework's.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Response
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from api import openai_routes
from api.errors import ApiError, error_response

log = logging.getLogger(__name__)


def create_app(handles: Any) -> QuartTrio:
    app = QuartTrio(__name__)
    # Quart's 60 s default silently cuts any stream that runs longer (trio-stack.md §2.4).
    app.config["RESPONSE_TIMEOUT"] = None
    app.register_blueprint(openai_routes.blueprint(handles))

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        if status in (404, 405):  # no 405 anywhere: a wrong method is an unknown route (spec §1.1)
            return error_response(ApiError(404, "not found", code="not_found"))
        return error_response(ApiError(status, error.description or error.name))

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        log.error("unhandled error", exc_info=error)  # the stack stays server-side
        return error_response(ApiError(500, str(error) or type(error).__name__))

    return app

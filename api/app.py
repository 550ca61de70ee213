"""The quart-trio application factory.

`create_app(handles)` wires the routes to already-running actors; the app starts nothing and
owns nothing (no `before_serving`, no `app.nursery`): the actors live in the root's nursery and
hypercorn is run by the root (actors/root.py), so shutdown order is ours, not the framework's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from api import admin_routes, pool_routes, ui_routes
from api.adapters import routes as adapter_routes
from api.anthropic import routes as anthropic_routes
from api.embeddings.routes import blueprint as embeddings_blueprint
from api.embeddings.routes import install_embedding_guard
from api.errors import ApiError, error_response_for
from api.http.security import install_security
from api.observability.health import install_health
from api.observability.metrics import install_metrics
from api.observability.pool_metrics import install_pool_metrics
from api.observability.request_log import install_request_log
from api.observability.tracing import install_tracing
from api.openai import routes as openai_routes
from api.responses import routes as responses_routes
from api.utilities import routes as utility_routes

if TYPE_CHECKING:
    from actors.handles import ServerHandles

log = logging.getLogger(__name__)


def create_app(handles: ServerHandles) -> QuartTrio:
    app = QuartTrio(__name__)
    # Quart's 60 s default silently cuts any stream that runs longer.
    app.config["RESPONSE_TIMEOUT"] = None
    # Auth / CORS / body cap first, then /health's truth, per-request logs and /metrics.
    install_security(app, handles.options)
    install_health(app, handles)
    install_request_log(app, handles)
    metrics = install_metrics(app, handles)
    install_tracing(app, handles)  # off (and importing no OpenTelemetry) unless configured
    app.register_blueprint(openai_routes.blueprint(handles))
    app.register_blueprint(anthropic_routes.blueprint(handles))
    app.register_blueprint(responses_routes.blueprint(handles))
    app.register_blueprint(admin_routes.blueprint(handles))  # POST /admin/cache/flush
    if handles.pool is not None:  # POST /admin/models/load, /admin/models/unload, /admin/drain
        app.register_blueprint(pool_routes.blueprint(handles, handles.pool))
        install_pool_metrics(metrics.registry, handles.pool)  # per-model series on /metrics
    app.register_blueprint(ui_routes.blueprint(handles.options.http.ui))  # GET / and /ui/*: the chat page
    app.register_blueprint(adapter_routes.blueprint(handles))  # /v1/adapters*
    app.register_blueprint(embeddings_blueprint(handles))  # POST /v1/embeddings
    app.register_blueprint(utility_routes.blueprint(handles))  # /tokenize, /detokenize, /apply-template, /v1, /fit
    install_embedding_guard(app, handles)  # an embedding model refuses the generation routes

    def error_response(error: ApiError) -> Response:
        # Each API answers in its own envelope, 404s for unknown sub-paths included.
        return error_response_for(request.path, error)

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        if status == 404:
            return error_response(ApiError(404, "not found", code="not_found"))
        if status == 405:  # a known path with the wrong method: 405 with its Allow header, not 404
            allow = {k: v for k, v in error.get_headers() if k.lower() == "allow"}
            return error_response(ApiError(405, "method not allowed", code="method_not_allowed", headers=allow))
        return error_response(ApiError(status, error.description or error.name))

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        log.error("unhandled error", exc_info=error)  # the stack stays server-side
        return error_response(ApiError(500, str(error) or type(error).__name__))

    return app

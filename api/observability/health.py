"""/health that tells the truth: 503 with a reason when the engine cannot serve.

The healthy answer stays the route's own byte-exact `{"status": "ok"}` (api/openai/routes.py);
this hook only answers first when something is wrong, so a dead engine never looks healthy
while requests hang:

* `model not loaded` — the handles carry no model info;
* `gpu worker is not running` — the worker reports `alive == False` (its MLX thread died or was
  never started); a worker without an `alive` flag counts as alive;
* `shutting down` — admission is closed (a draining server leaves the load balancer's rotation).

A model whose isolated engine (`--isolate`) died more often than it may be restarted has failed
for good: /health says `{"status": "degraded", "failed": {model: why}}`, with 503 when that was
the server's one model, and 200 in a model pool whose other models still serve. While an engine
is being restarted, the single model's /health is 503 `gpu worker is not running`.

Every 503 carries Retry-After. While the model loads, api/http/lifecycle.py answers
`{"status": "loading"}` with 503 before this app exists.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from quart import Response, request
from quart_trio import QuartTrio

from actors.admission import RETRY_AFTER_S

if TYPE_CHECKING:
    from actors.handles import ServerHandles


def health_problem(handles: ServerHandles) -> str | None:
    """Why the server cannot serve right now, or None."""
    if handles.info is None:
        return "model not loaded"
    if not handles.worker_alive():
        return "gpu worker is not running"
    if handles.admission.closed:
        return "shutting down"
    return None


def unhealthy_response(reason: str) -> Response:
    body = json.dumps({"status": "unavailable", "reason": reason})
    headers = {"Cache-Control": "no-store", "Retry-After": str(max(1, round(RETRY_AFTER_S)))}
    return Response(body, status=503, content_type="application/json", headers=headers)


def degraded_response(failed: dict[str, str], *, serving: bool) -> Response:
    """Some models failed for good: 200 while others serve (a pool), else 503."""
    body = json.dumps({"status": "degraded", "failed": failed})
    headers = {"Cache-Control": "no-store"}
    if not serving:
        headers["Retry-After"] = str(max(1, round(RETRY_AFTER_S)))
    return Response(body, status=200 if serving else 503, content_type="application/json", headers=headers)


def install_health(app: QuartTrio, handles: ServerHandles) -> None:
    @app.before_request
    async def health_gate() -> Response | None:
        if request.path != "/health" or request.method not in ("GET", "HEAD"):
            return None
        failed = handles.failed_models()
        if failed and not handles.admission.closed:
            return degraded_response(failed, serving=handles.pool is not None and handles.pool.alive())
        problem = health_problem(handles)
        return None if problem is None else unhealthy_response(problem)

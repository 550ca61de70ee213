"""Admin routes of the model pool (actors/pool.py), served only when the pool is on:

* `POST /admin/models/load {"model": id}` — load it now (or mark it most recently used):
  `{"model", "status": "loaded", "weights_bytes", "elapsed_ms"}`.
* `POST /admin/models/unload {"model": id, "force": true}` — unload it once its running rows
  have ended (new requests naming it wait, then load it again); with `"force": false`, a model
  with running rows answers 409 `model_busy` instead of waiting. With `--ssd-cache` its RAM prompt
  cache goes to the SSD tier first: the answer's `drain` counts.
* `POST /admin/drain {"model": id}` — the same drain for a model that stays: new requests for it
  wait, its running rows end, its prompt cache is demoted to the SSD tier, then it serves again
  (default: the default model).

Each answers an unknown model 404 `model_not_found`. Access control is /admin/*'s
(api/http/security.py): loopback, or the admin token.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Blueprint, Response, request

from actors.handles import ModelPoolView, ServerHandles
from actors.pool_types import PoolError
from actors.ssd.drain import DrainReport
from api.errors import bad_request
from api.http.wire import json_body, json_response
from api.model_names import model_not_found, pool_error, served_names


def drain_body(report: DrainReport) -> dict[str, Any]:
    return {
        "demoted": report.demoted,
        "written": report.written,
        "failed": report.failed,
        "durable": report.durable,
        "ssdEntries": report.ssd_entries,
        "elapsedMs": report.elapsed_ms,
    }


def blueprint(server: ServerHandles, pool: ModelPoolView) -> Blueprint:
    bp = Blueprint("admin_models", __name__)

    async def named(*, required: bool = True) -> tuple[str, dict[str, Any]]:
        body = await json_body() if required or await request.get_data() else {}
        name = body.get("model")
        if name is None and not required:
            name = served_names(server)[0]
        if not isinstance(name, str) or not name:
            raise bad_request("model must be a non-empty string", param="model")
        model_id = pool.find(name)
        if model_id is None:
            raise model_not_found(server, name)
        return model_id, body

    @bp.post("/admin/models/load")
    async def load() -> Response:
        model_id, _ = await named()
        started = trio.current_time()
        try:
            handles = await pool.acquire(model_id)
        except PoolError as exc:
            raise pool_error(exc) from None
        elapsed = round((trio.current_time() - started) * 1000, 3)
        body = {"model": model_id, "status": "loaded", "weights_bytes": handles.info.weights_bytes}
        return json_response({**body, "elapsed_ms": elapsed})

    @bp.post("/admin/models/unload")
    async def unload() -> Response:
        model_id, body = await named()
        force = body.get("force", True)
        if not isinstance(force, bool):
            raise bad_request("force must be a boolean", param="force")
        try:
            report = await pool.unload(model_id, wait=force)
        except PoolError as exc:
            raise pool_error(exc) from None
        return json_response({"model": model_id, "status": "unloaded", "drain": drain_body(report)})

    @bp.post("/admin/drain")
    async def drain() -> Response:
        model_id, _ = await named(required=False)
        try:
            report = await pool.drain(model_id)
        except PoolError as exc:
            raise pool_error(exc) from None
        return json_response({"model": model_id, **drain_body(report)})

    return bp

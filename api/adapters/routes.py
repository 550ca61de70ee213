"""LoRA adapter routes: list, mount and unmount at runtime; list what `--adapters-dir` offers.

* `GET /v1/adapters` — the mounted adapters.
* `POST /v1/adapters {"id", "path"}` — mount (`path` may be left out with `--adapters-dir`: that
  directory's `<id>`); 200 with the adapter, 409 if the id is mounted, 400 with the engine's
  reason when it cannot mount (no such directory, shapes that do not fit, a full fine-tune, ...).
  An id unmounted while rows still use it is kept when mounted again from the same path and
  weights (200: the unmount is cancelled); from other weights it is a 409 until those rows end.
* `DELETE /v1/adapters/{id}` — 200 `{"id", "unmounted"}`: true when it is gone now, false when it
  leaves once the rows using it finish (new requests can no longer name it either way); 404 when
  it is not mounted.
* `GET /v1/adapters/available` — the directories under `--adapters-dir` (api/adapters/catalog.py).

Access is the admin routes' (api/http/security.py: loopback clients, else `--admin-token`): mounting
loads files from the server's disk. Errors are OpenAI's envelope (api/errors.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quart import Blueprint, Response

from actors.adapter_registry import AdapterConflict, AdapterDraining, AdapterMissing
from actors.handles import ServerHandles
from actors.worker_api import AdapterReport
from api.adapters.catalog import read_model_config, scan
from api.errors import ApiError, bad_request
from api.http import offload
from api.http.wire import json_body, json_response
from api.model_names import current, default_handles, model_name
from model.lora.ids import adapter_id_problem


def blueprint(server: ServerHandles) -> Blueprint:
    """The default model's adapters (with a model pool, its latest load's)."""
    bp = Blueprint("adapters", __name__)

    @bp.get("/v1/adapters")
    async def mounted() -> Response:
        handles = current(server)
        return json_response({"object": "list", "data": [adapter_body(handles, r) for r in handles.adapters.infos()]})

    @bp.post("/v1/adapters")
    async def mount() -> Response:
        handles = await default_handles(server)
        adapter_id, path = mount_request(handles, await json_body())
        try:
            report = await handles.adapters.mount(adapter_id, path)
        except AdapterDraining as exc:  # (it is no longer listed: "already mounted" would puzzle)
            raise ApiError(409, str(exc), param="id", code="adapter_draining") from None
        except AdapterConflict as exc:
            raise ApiError(409, str(exc), param="id", code="adapter_already_mounted") from None
        except ValueError as exc:  # the engine's reason, one line
            raise bad_request(str(exc), param="path", code="adapter_not_mountable") from None
        return json_response(adapter_body(handles, report))

    @bp.delete("/v1/adapters/<adapter_id>")
    async def unmount(adapter_id: str) -> Response:
        handles = current(server)
        try:
            gone = await handles.adapters.unmount(adapter_id)
        except AdapterMissing:
            raise ApiError(404, f"adapter {adapter_id!r} is not mounted", code="adapter_not_found") from None
        return json_response({"id": adapter_id, "unmounted": gone})

    @bp.get("/v1/adapters/available")
    async def available() -> Response:
        handles = current(server)
        directory = handles.options.adapters.adapters_dir
        if not directory:
            return json_response({"object": "list", "adapters_dir": None, "data": []})
        entries = await offload.to_thread(_scan, handles, Path(directory))
        return json_response({"object": "list", "adapters_dir": directory, "data": entries})

    return bp


def adapter_body(handles: ServerHandles, report: AdapterReport) -> dict[str, Any]:
    return {
        "id": report.id,
        "object": "adapter",
        "model": f"{model_name(handles)}:{report.id}",  # the `model` name that selects it
        "path": report.path,
        "type": report.fine_tune_type,
        "rank": report.rank,
        "bytes": report.nbytes,
        "fingerprint": report.fingerprint,
    }


def mount_request(handles: ServerHandles, body: dict[str, Any]) -> tuple[str, str]:
    """(id, path) of a POST body; `path` defaults to `--adapters-dir`/id. Raises 400."""
    adapter_id, path = body.get("id"), body.get("path")
    if not isinstance(adapter_id, str) or not adapter_id:
        raise bad_request("id must be a non-empty string", param="id")
    if problem := adapter_id_problem(adapter_id):
        raise bad_request(problem, param="id", code="adapter_not_mountable")
    if path is None and handles.options.adapters.adapters_dir:
        path = str(Path(handles.options.adapters.adapters_dir) / adapter_id)
    if not isinstance(path, str) or not path:
        raise bad_request("path must be a non-empty string (the adapter directory)", param="path")
    return adapter_id, path


def _scan(handles: ServerHandles, directory: Path) -> list[dict[str, Any]]:
    entries = scan(directory, read_model_config(_model_dir(handles)))
    for entry in entries:
        entry["mounted"] = entry["id"] in handles.adapters
    return entries


def _model_dir(handles: ServerHandles) -> Path | None:
    """The served model's directory (its config.json has the sizes to compare with)."""
    try:
        if handles.options.model.model:
            from model.load.resolve import resolve_model_dir

            return Path(resolve_model_dir(handles.options.model.model))
        from model.load.demo import ensure_demo_model

        return Path(ensure_demo_model())
    except Exception:  # noqa: BLE001 - compatibility is then "unknown", never an error
        return None

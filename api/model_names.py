"""The names the server's one model answers to, and the check every generation route makes.

* Served names: `--served-model-name A [B ...]`, else the model's own name (`org/name` for a
  Hugging Face cache snapshot, a local directory's name, the demo's name). The first is the name
  replies carry; /v1/models lists every one.
* A request's `model` may be a served name or an alias kept so clients written against the
  `--model` value keep working: that string as given, the resolved model directory, and
  mlx_lm.server's `default_model`.
* A request without `model`, or with "", gets the one model: there is no other to mean, and
  clients that omit it (as mlx_lm.server allows) keep working.
* `<name>:<adapter>` (`<name>` one of the above) is the model with that mounted LoRA adapter
  (`a+b` stacks two): what /v1/models lists per adapter (api/adapters/select.py).
* Any other name is a 404 `model_not_found` in the route's own envelope (the app's error
  handler picks it from the path) that names the models this server serves, so a client can fix
  its `model` without a second call; a `model` that is not a string is a 400.
* With a model pool (actors/pool.py), `model_handles` first picks the model a request names
  among every servable one (a request without `model` gets the default, the `--model`), loading
  it when it is not resident; the checks above then run against that model's own handles.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from actors.handles import ModelPoolView, ServerHandles
from actors.pool_types import PoolError
from actors.request import observing
from api.adapters.select import parse_adapters, select_adapters
from api.errors import ApiError, bad_request
from api.http.wire import json_body
from api.observability.request_log import RequestRecord
from model.load.resolve import resolve_model_dir

DEFAULT_MODEL_ALIAS = "default_model"  # mlx_lm.server's name for "the model the server was started with"
_ECHO_MAX = 256  # longest requested name echoed in the error message
_LISTED_MAX = 8  # served names (adapters included) a 404 lists before "and N more"


def served_names(handles: ServerHandles) -> tuple[str, ...]:
    """The names /v1/models lists, the reply name first."""
    return tuple(dict.fromkeys(handles.options.model.served_model_name or (handles.info.name,)))


def model_name(handles: ServerHandles, adapters: Sequence[str] = ()) -> str:
    """The name replies carry: the served name, with the adapters a request ran on as /v1/models
    names them (`<name>:a`, `<name>:a+b`), whichever way the request chose them."""
    name = served_names(handles)[0]
    return f"{name}:{'+'.join(adapters)}" if adapters else name


def accepted_names(handles: ServerHandles) -> frozenset[str]:
    """Every `model` value a request may name: the served names and the aliases."""
    names = {*served_names(handles), DEFAULT_MODEL_ALIAS}
    spec = handles.options.model.model
    if spec:
        names.add(spec)
        names.update(_resolved(spec))
    return frozenset(name.rstrip("/") or name for name in names)


def check_requested_model(
    handles: ServerHandles, body: Mapping[str, Any], *, default_adapter: bool = True
) -> tuple[str, ...]:
    """Raise unless `body["model"]` is absent, empty, one of the accepted names, or one with an
    adapter part; return the LoRA adapters the request stacks (the model name's or its
    `adapter` field's, else the server's default when `default_adapter`: api/adapters/select.py)."""
    requested = body.get("model")
    from_model: tuple[str, ...] | None = None
    if requested is not None and requested != "":
        if not isinstance(requested, str):
            raise bad_request("model must be a string", param="model")
        accepted = accepted_names(handles)
        if (requested.rstrip("/") or requested) not in accepted:
            base, sep, adapters = requested.rpartition(":")  # adapter ids never hold ":"
            if not sep or (base.rstrip("/") or base) not in accepted or not adapters:
                raise model_not_found(handles, requested)
            from_model = parse_adapters(handles.adapters, adapters, param="model")
    default = handles.options.adapters.default if default_adapter else None
    return select_adapters(handles.adapters, body, from_model, default)


def adapter_model_names(handles: ServerHandles) -> list[tuple[str, str]]:
    """(`<served-name>:<adapter-id>`, served name) for each mounted adapter, as /v1/models lists them."""
    name = model_name(handles)
    return [(f"{name}:{report.id}", name) for report in handles.adapters.infos()]


async def model_handles(server: ServerHandles) -> ServerHandles:
    """The handles of the model the request's `model` names: `server` itself without a pool;
    with one, the named model's, loaded first when it is not resident (a 404 for a name no
    servable model has, a 503 + Retry-After when it cannot load in time). The route enters the
    model's arrivals right after, with no checkpoint between: the pool never unloads it then."""
    pool = server.pool
    if pool is None:
        return server
    requested = (await json_body()).get("model")
    if requested is None or requested == "":
        requested = served_names(server)[0]
    if not isinstance(requested, str):
        raise bad_request("model must be a string", param="model")
    model_id = pool.find(requested)
    if model_id is None:
        base, sep, adapters = requested.rpartition(":")  # `<name>:<adapter>`: the adapter's base model
        model_id = pool.find(base) if sep and adapters else None
    if model_id is None:
        raise model_not_found(server, requested)
    try:
        handles = await pool.acquire(model_id)
    except PoolError as exc:
        raise pool_error(exc) from None
    record = observing.get()
    if isinstance(record, RequestRecord):  # the request log names the model (and decodes with its tokenizer)
        record.model, record.tokenizer = model_id, handles.tokenizer
    return handles


def current(server: ServerHandles) -> ServerHandles:
    """The default model's handles as they are now: with a model pool, its latest load's while
    it is resident (the app was built with its first load's), else `server`."""
    if server.pool is None:
        return server
    return server.pool.resident(server.info.name) or server


async def default_handles(server: ServerHandles) -> ServerHandles:
    """The default model's handles, loaded first when a model pool had unloaded it (mounting a
    LoRA adapter needs its worker)."""
    if server.pool is None:
        return server
    try:
        return await server.pool.acquire(served_names(server)[0])
    except PoolError as exc:
        raise pool_error(exc) from None


def pool_error(exc: PoolError) -> ApiError:
    """A pool's refusal as the route's HTTP error."""
    headers = {} if exc.retry_after is None else {"Retry-After": str(max(1, round(exc.retry_after)))}
    return ApiError(
        exc.status, exc.message, param="model" if exc.status == 404 else None, code=exc.code, headers=headers
    )


def _pool_names(pool: ModelPoolView) -> list[str]:
    return [entry.id for entry in pool.entries()]


def model_not_found(handles: ServerHandles, name: str) -> ApiError:
    """The 404 for `name`, listing what the server serves (the served names, then the mounted
    adapters' `<name>:<id>`; with a model pool, every servable model)."""
    shown = name if len(name) <= _ECHO_MAX else name[:_ECHO_MAX] + "..."
    served = [*served_names(handles), *(adapter for adapter, _ in adapter_model_names(handles))]
    if handles.pool is not None:
        served = list(dict.fromkeys([*_pool_names(handles.pool), *served]))
    listed = ", ".join(f"`{served_name}`" for served_name in served[:_LISTED_MAX])
    if len(served) > _LISTED_MAX:
        listed += f" and {len(served) - _LISTED_MAX} more (GET /v1/models lists them)"
    return ApiError(
        404,
        f"The model `{shown}` does not exist. This server serves {listed}.",
        param="model",
        code="model_not_found",
    )


@functools.lru_cache(maxsize=4)
def _resolved(spec: str) -> tuple[str, ...]:
    """The directory `--model` resolved to (once per process: it only reads the filesystem)."""
    try:
        path = resolve_model_dir(spec)
    except Exception:  # noqa: BLE001 — a vanished directory only loses the alias
        return ()
    return (str(path), str(Path(spec).expanduser()))

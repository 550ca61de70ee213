"""Which LoRA adapters a generation request stacks: its `adapter` field, or its `model` name.

* `"adapter": "a"` — one mounted adapter; `"a+b"` — both, their deltas summed (in this order);
  `"none"` (or "") — the base model; absent or null — the server's default adapter while it is
  mounted (`--default-adapter`, or the one `--adapter` given: model/options/groups.py
  `AdapterOptions.default`), else the base model.
* `"model": "<served-name>:<id>"` (or `:a+b`) says the same (what /v1/models lists for each
  mounted adapter); api/model_names.py splits it off the served name.
* Both given and naming different adapters is a 400; an id that is not mounted is a 400
  (`invalid_request_error`, code `adapter_not_found`, `param` the field that named it), answered
  before the request is queued. So is a stack the engine cannot run, a DoRA adapter with another
  (code `adapter_not_stackable`), from the kinds the registry keeps. An adapter unmounted after
  this check fails the request's row when it opens: that too is a 400 (actors/request.py), never a
  neighbour's failure.
"""

from __future__ import annotations

from typing import Any

from actors.adapter_registry import AdapterRegistry, stack_problem
from api.errors import ApiError
from model.lora.ids import NO_ADAPTER


def parse_adapters(registry: AdapterRegistry, value: Any, *, param: str) -> tuple[str, ...]:
    """The ids `value` names, each mounted. Raises `ApiError` (400)."""
    if value is None or value == "" or value == NO_ADAPTER:
        return ()
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string: an adapter id, ids joined by '+', or 'none'", param=param)
    ids = tuple(value.split("+"))
    if any(not i or i == NO_ADAPTER for i in ids):
        raise ApiError(400, f"{param} {value!r}: join adapter ids with '+' ('none' stands alone)", param=param)
    if len(set(ids)) != len(ids):
        raise ApiError(400, f"{param} {value!r} names an adapter twice", param=param)
    reports = []
    for adapter_id in ids:
        report = registry.get(adapter_id)
        if report is None:
            raise not_mounted(registry, adapter_id, param)
        reports.append(report)
    if problem := stack_problem(reports):
        raise ApiError(400, f"{param} {value!r}: {problem}", param=param, code="adapter_not_stackable")
    return ids


def not_mounted(registry: AdapterRegistry, adapter_id: str, param: str) -> ApiError:
    shown = adapter_id if len(adapter_id) <= 128 else adapter_id[:128] + "..."
    mounted = ", ".join(sorted(r.id for r in registry.infos())) or "none"
    return ApiError(
        400,
        f"adapter {shown!r} is not mounted (mounted: {mounted})",
        param=param,
        code="adapter_not_found",
    )


def select_adapters(
    registry: AdapterRegistry, body: Any, from_model: tuple[str, ...] | None, default: str | None = None
) -> tuple[str, ...]:
    """The request's adapters: `body["adapter"]`, or those its model name gave (`from_model`,
    None when the name had no adapter part), or neither: `default` while it is mounted. Raises
    `ApiError` (400)."""
    field = body.get("adapter") if isinstance(body, dict) else None
    if field is None and from_model is None:
        return (default,) if default is not None and registry.get(default) is not None else ()
    chosen = parse_adapters(registry, field, param="adapter")
    if from_model is None or (field is None or field == ""):
        return chosen if from_model is None else from_model
    if chosen != from_model:
        raise ApiError(
            400,
            f"adapter {field!r} and model name different adapters: give one of them",
            param="adapter",
        )
    return chosen

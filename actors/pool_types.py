"""The plain values of the model pool (actors/pool.py) that the HTTP app reads: a model's entry in
the listing, and the pool's refusals, each with the HTTP status it answers."""

from __future__ import annotations

from typing import Literal

import attrs

Status = Literal["loaded", "loading", "unloaded", "failed"]  # failed: its isolated engine kept dying


@attrs.frozen
class PoolEntry:
    """A servable model as /v1/models lists it."""

    id: str
    status: Status
    weights_bytes: int = 0  # 0 until loaded
    error: str | None = None  # why it failed (status "failed")
    loaded_at: float | None = None  # wall clock (time.time()) of its last load
    idle_s: float | None = None  # since its last request ended (None: running rows, or not resident)
    default: bool = False  # what a request without `model` gets


class PoolError(Exception):
    """A request the pool cannot serve; `status` and `code` are its HTTP answer."""

    status = 503
    code = "model_unavailable"
    retry_after: float | None = None

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retry_after is not None:
            self.retry_after = retry_after


class ModelUnknown(PoolError):
    """No servable model has that name (404; the route lists what is servable)."""

    status = 404
    code = "model_not_found"


class ModelLoadFailed(PoolError):
    """The model's load failed: 503 with Retry-After (the next request tries again)."""

    code = "model_load_failed"
    retry_after = 5.0


class PoolBusy(PoolError):
    """No load finished within --model-load-timeout (the pool is full of running models): 503."""

    code = "model_pool_busy"
    retry_after = 5.0


class PoolClosed(PoolError):
    """The server is shutting down: no model loads any more (503, as admission's own refusal)."""

    code = "shutting_down"
    retry_after = 1.0


class ModelNotLoaded(PoolError):
    """A drain of a model that is not resident (409)."""

    status = 409
    code = "model_not_loaded"


class ModelBusy(PoolError):
    """An unload asked not to wait (`"force": false`) met running rows (409)."""

    status = 409
    code = "model_busy"

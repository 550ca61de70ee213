"""Admin routes of the cache SSD tier: POST /admin/cache/flush.

The flush is single-flight (concurrent callers share one) and makes every dirty prompt-cache
record durable now, writing without waiting for an idle engine. Body: the flush result
(camelCase keys) plus `entries` and `longest_durable_prefix_tokens`; 200 when durable, 503
otherwise. Without --ssd-cache: 200 with zeros. With a model pool it flushes the default
model's tier (every tier flushes at shutdown; `POST /admin/drain` empties another model's RAM
tier onto its SSD tier). Access control for /admin/* is api/http/security.py's (loopback, or the
admin token).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from quart import Blueprint, Response

from api.model_names import current

if TYPE_CHECKING:
    from actors.handles import ServerHandles
    from actors.messages import FlushResult
    from actors.ssd.view import SsdView


def flush_body(result: FlushResult, ssd: SsdView | None) -> dict[str, Any]:
    tier = {} if ssd is None else ssd.stats()
    return {
        "durable": result.durable,
        "flushedSnapshots": result.flushed_snapshots,
        "missingSnapshots": result.missing_snapshots,
        "pendingSnapshots": result.pending_snapshots,
        "pendingSpills": result.pending_spills,
        "pendingSpillBytes": result.pending_spill_bytes,
        "droppedSpills": result.dropped_spills,
        "failedSpills": result.failed_spills,
        "elapsedMs": result.elapsed_ms,
        "entries": tier.get("entries", 0),
        "longest_durable_prefix_tokens": tier.get("longest_durable_prefix_tokens", 0),
    }


def blueprint(handles: ServerHandles) -> Blueprint:
    bp = Blueprint("admin_cache", __name__)

    @bp.post("/admin/cache/flush")
    async def flush() -> Response:
        model = current(handles)  # (with a model pool: the default model's latest load)
        result = await model.flush_cache()
        body = flush_body(result, model.ssd)
        return Response(json.dumps(body), status=200 if result.durable else 503, content_type="application/json")

    return bp

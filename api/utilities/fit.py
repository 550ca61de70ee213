"""`GET /fit`: how the model fits this machine, in one answer.

* `machine`: the device (its name, backend, memory) and its memory bandwidth, measured once on
  the worker (model/engine/machine.py; null from a worker that cannot measure).
* `model`: weights, KV bytes per token and the KV scheme; the context window, the longest
  context one row may reach within the memory budget, and the rows the server decodes at once
  with the context each of them may reach when all are that long (admission's rules,
  actors/policy.py).
* `decode`: the predicted tokens per second (the bandwidth roofline: a decode step reads every
  weight and each row's KV once, so these are upper bounds) for one row and for a full batch at
  `PREDICT_CONTEXT` tokens each, and the measured rate so far (the worker's step time and the
  tokens its rows produced; null before the first step).
"""

from __future__ import annotations

from typing import Any

from actors.handles import ReportsMachine, ReportsTimes, ServerHandles

PREDICT_CONTEXT = 1024  # tokens each row holds in the predictions: a short conversation


async def fit(handles: ServerHandles) -> dict[str, Any]:
    info, ceiling = handles.info, handles.ceiling
    rows = handles.resolved.batch if handles.mode == "batch" else 1
    machine = await handles.worker.machine() if isinstance(handles.worker, ReportsMachine) else None
    bandwidth = machine.bandwidth_bytes_s if machine is not None else None
    return {
        "machine": {
            "device": info.device,
            "device_name": machine.device_name if machine is not None else None,
            "backend": info.backend,
            "memory_bytes": info.memory_bytes,
            "memory_budget_bytes": ceiling.memory_budget_bytes,
            "bandwidth_gbs": None if bandwidth is None else round(bandwidth / 1e9, 2),
        },
        "model": {
            "name": info.name,
            "weights_bytes": info.weights_bytes,
            "adapter_bytes": ceiling.adapter_bytes,
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "kv_scheme": info.kv_scheme,
            "context_length": info.context_length,
            "max_safe_context": ceiling.max_safe_context,
            "batch_rows": rows,
            "max_context_per_row_in_full_batch": min(ceiling.memory_context(rows), info.context_length),
        },
        "decode": {
            "predicted": _predicted(handles, bandwidth, rows),
            "measured": _measured(handles),
        },
    }


def _predicted(handles: ServerHandles, bandwidth: float | None, rows: int) -> dict[str, Any] | None:
    if bandwidth is None:
        return None
    info = handles.info
    weights = info.weights_bytes + handles.ceiling.adapter_bytes
    per_row = info.kv_bytes_per_token * PREDICT_CONTEXT + info.state_bytes_per_row

    def rate(batch: int) -> float:
        return round(batch * bandwidth / max(1, weights + batch * per_row), 1)

    return {"context": PREDICT_CONTEXT, "row_tok_s": rate(1), "batch_rows": rows, "batch_tok_s": rate(rows)}


def _measured(handles: ServerHandles) -> dict[str, Any] | None:
    """The worker's decode steps so far: a row's rate is one token per step, the server's the
    tokens its rows produced over the steps' time."""
    worker = handles.worker
    if not isinstance(worker, ReportsTimes):
        return None
    times = worker.times.snapshot()
    steps, seconds = times["jobs"].get("step", 0), times["busy_s"].get("step", 0.0)
    if not steps or seconds <= 0:
        return None
    step_s = seconds / steps
    return {
        "steps": steps,
        "mean_step_ms": round(step_s * 1e3, 3),
        "row_tok_s": round(1 / step_s, 1),
        "tok_s": round(handles.scheduler.counters.tokens / seconds, 1),
    }

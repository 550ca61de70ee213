"""Where a row's prefill puts snapshots of its KV: the template-stable boundary (cache/boundary.py)
and a client's retention hints (`RowSpec.retain`), as one ascending plan for the engine."""

from __future__ import annotations

from model.engine.rows import RowSpec

# (prompt position, retention seconds; None = an ordinary LRU entry)
Snapshot = tuple[int, float | None]


def snapshot_plan(spec: RowSpec, restored: int, min_tokens: int) -> list[Snapshot]:
    """Each position is clamped to the prompt minus its last token (that one is forwarded at the
    join) and kept only when it is at least `min_tokens` long and beyond the restored prefix; a
    position named twice keeps its longest retention."""
    last = len(spec.prompt) - 1
    plan: dict[int, float | None] = {}
    wanted: list[Snapshot] = [] if spec.snapshot_at is None else [(spec.snapshot_at, None)]
    for at, retain_s in [*wanted, *spec.retain]:
        at = min(at, last)
        if at >= min_tokens and at > restored:
            held = plan.get(at)
            plan[at] = retain_s if held is None else max(held, retain_s or 0.0)
    return sorted(plan.items())


def retained_length(plan: list[Snapshot]) -> int:
    """The longest hinted position in the plan: the prompt tokens a row stores at its hints."""
    return max((at for at, retain_s in plan if retain_s is not None), default=0)

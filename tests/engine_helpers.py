"""Driving an `Engine` directly, without the actors: run rows to completion (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence

from model.engine.engine import Engine
from model.engine.rows import RowSpec


def generate_tokens(engine: Engine, specs: Sequence[RowSpec], *, reusable: bool = False) -> dict[int, list[int]]:
    """Run rows to completion together (test/bench helper): {row_id: generated tokens}.
    `reusable` is close_row's: finished rows are put to the engine's prompt cache."""
    out: dict[int, list[int]] = {}
    live: set[int] = set()
    for spec in specs:
        admit(engine, spec, out, live, reusable=reusable)
    return decode_to_the_end(engine, out, live, reusable=reusable)


def admit(engine: Engine, spec: RowSpec, out: dict[int, list[int]], live: set[int], *, reusable: bool = False) -> int:
    """Open, prefill and join one row (test/bench helper): its first token into `out`, the row into
    `live` unless that token finished it (then closed); returns the cached tokens at open."""
    cached = engine.open_row(spec).cached_tokens
    while engine.prefill(spec.row_id).remaining:
        pass
    first = engine.join(spec.row_id)
    out[spec.row_id] = [first.token]
    if first.finish:
        engine.close_row(spec.row_id, reusable=reusable)
    else:
        live.add(spec.row_id)
    return cached


def decode_to_the_end(
    engine: Engine, out: dict[int, list[int]], live: set[int], *, reusable: bool = False
) -> dict[int, list[int]]:
    """Step until every `live` row has finished, appending each token to `out[row_id]` and
    closing rows as they finish (test/bench helper); returns `out`."""
    while live:
        for t in engine.step():
            out[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id, reusable=reusable)
                live.discard(t.row_id)
    return out

"""Driving the Gemma 3 / 4 engine rows in the family tests."""

from __future__ import annotations

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.options import EngineOptions


def engine_for(model, **kw):
    options = kw.pop("options", {})
    return Engine(model, eos_token_ids=[], options=EngineOptions(**options), **kw)


def spec(row_id, prompt, n=32):
    return RowSpec(row_id, tuple(prompt), SamplingParams(), n)


def run_row_to_join(engine, s):
    engine.open_row(s)
    while engine.prefill(s.row_id).remaining:
        pass
    return engine.join(s.row_id).token


def run_cached(engine, prompt, n):
    opened = engine.open_row(spec(0, prompt, n))
    while engine.prefill(0).remaining:
        pass
    out = [engine.join(0)]
    while not out[-1].finish:
        out += engine.step()
    engine.close_row(0, reusable=True)
    return opened.cached_tokens, [t.token for t in out]

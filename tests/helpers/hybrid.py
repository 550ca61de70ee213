"""Driving the hybrid (Qwen 3.5) engine rows in the family tests."""

from __future__ import annotations

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens


def engine_for(model, cache=None, **options):
    return Engine(model, eos_token_ids=[], prompt_cache=cache, options=EngineOptions(**options))


def spec(row_id, prompt, n=16, **kw):
    return RowSpec(row_id, tuple(prompt), SamplingParams(), n, **kw)


def run_row_to_join(engine, s):
    engine.open_row(s)
    while engine.prefill(s.row_id).remaining:
        pass
    return engine.join(s.row_id).token


def cold(model, prompt, n=12):
    return generate_tokens(engine_for(model, prefill_chunk=64), [spec(0, prompt, n)])[0]


def run(engine, s, reusable=True):
    opened = engine.open_row(s)
    out = generate_tokens_after_open(engine, s.row_id, reusable)
    return opened.cached_tokens, out


def generate_tokens_after_open(engine, row_id, reusable):
    while engine.prefill(row_id).remaining:
        pass
    out = [engine.join(row_id)]
    while not out[-1].finish:
        out += engine.step()
    engine.close_row(row_id, reusable=reusable)
    return [t.token for t in out]

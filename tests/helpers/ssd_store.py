"""An SSD store and a tiered engine over it, for the SSD tier's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cache.spill_item import SpillItem
from cache.ssd_identity import Identity, model_fingerprint, scheme_key, tokenizer_hash
from cache.ssd_store import SsdStore
from cache.tiered import TieredPromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from tests.engine_helpers import generate_tokens

RNG = np.random.default_rng(7)


PROMPT = tuple(int(x) for x in RNG.integers(1, 400, 200))


def identity_of(lm) -> Identity:
    return Identity(
        lm.name, model_fingerprint(lm.path), scheme_key(str(lm.kv_dtype).rsplit(".", 1)[-1]), tokenizer_hash(lm.path)
    )


def open_store(root: Path, lm, **kw) -> SsdStore:
    return SsdStore(root, identity_of(lm), max_bytes=kw.pop("max_bytes", 1 << 30), **kw).open()


def tiered_engine(lm, store, **kw):
    cache = TieredPromptCache(1 << 30, store, **kw)
    return Engine(lm.model, eos_token_ids=[], prompt_cache=cache), cache


def write_item(store: SsdStore, item: SpillItem) -> bool:
    writer = store.begin(item)
    assert writer is not None
    while writer.write_next():
        pass
    return writer.commit()


def store_prompt(lm, store, prompt=PROMPT, max_tokens=6, namespace=""):
    """Run `prompt` on a tiered engine, write its RAM entry to `store`; (entry tokens, output)."""
    engine, cache = tiered_engine(lm, store)
    out = generate_tokens(
        engine, [RowSpec(1, prompt, SamplingParams(), max_tokens, namespace=namespace)], reusable=True
    )[1]
    ((ns, tokens),) = cache.keys()
    assert write_item(store, cache.snapshot(tokens, ns))
    return tokens, out


def cold(lm, prompt, max_tokens=6):
    return generate_tokens(Engine(lm.model, eos_token_ids=[]), [RowSpec(9, prompt, SamplingParams(), max_tokens)])[9]


def run(engine, prompt, max_tokens=6, row_id=2):
    opened = engine.open_row(RowSpec(row_id, prompt, SamplingParams(), max_tokens))
    while engine.prefill(row_id).remaining:
        pass
    out = [engine.join(row_id).token]
    while len(out) < max_tokens:
        out += [t.token for t in engine.step()]
    engine.close_row(row_id)
    return opened.cached_tokens, out

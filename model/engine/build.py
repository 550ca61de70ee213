"""One engine builder: a loaded model and the options → an `Engine` and the facts about it.

The GPU worker (actors/gpu_worker.py) and a tensor-parallel follower (actors/tp/follower.py) build
their engines here, on the thread that will own them. What they do around it differs: the worker
first shards through the tensor-parallel leader and opens the prompt cache's tiers (cache/; the
builder takes the cache it made), the follower joins the ring and shards. Nothing here is global:
two builds in one process give two independent engines (a model pool builds one per model).

The steps: the KV scheme (--kv-quant, with the model's kv_config.json: `kv_scheme_for`, which
callers run first to fail early), speculative decoding (a
draft model must share the vocabulary; none under a quantized KV cache), the grammar compiler for
structured outputs (None without llguidance), the engine itself. Warm-up is the engine's own
`warm_up(rows)`, run by the caller once it knows the rows (`actors.options.resolve`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from model.engine.speculation_setup import SpecChoice, build_speculation
from model.kv.scheme import KVScheme
from model.kv.scheme import resolve as resolve_kv_scheme
from model.load.errors import ModelLoadError
from model.options import EngineOptions, KVOptions

if TYPE_CHECKING:
    from model.engine.abort_flags import AbortFlags
    from model.engine.engine import Engine
    from model.load.loader import LoadedModel


@attrs.frozen(eq=False)
class BuiltEngine:
    """An engine and what the server reports about it."""

    engine: Engine
    loaded: LoadedModel
    kv_scheme: KVScheme
    eos_token_ids: frozenset[int]
    speculation: str  # "" = off, else "draft:<name> k=K" or "ngram k=K n=MIN..MAX"


def kv_scheme_for(loaded: LoadedModel, options: KVOptions) -> KVScheme:
    """--kv-quant for the loaded model; a bad kv_config.json is a one-line ModelLoadError."""
    try:
        return resolve_kv_scheme(options, model_dir=loaded.path, num_layers=len(loaded.model.layers))
    except ValueError as e:
        raise ModelLoadError(str(e)) from e


def eos_of(loaded: LoadedModel, eos_token_ids: Iterable[int] | None) -> frozenset[int]:
    """The given end-of-sequence ids, else the checkpoint's."""
    return frozenset(loaded.config.eos_token_ids if eos_token_ids is None else eos_token_ids)


def build_engine(
    loaded: LoadedModel,
    *,
    engine: EngineOptions,
    kv_scheme: KVScheme,
    speculation: SpecChoice | None = None,
    eos_token_ids: Iterable[int] | None = None,
    protected_ids: Iterable[int] = (),
    prompt_cache: Any = None,
    aborts: AbortFlags | None = None,
) -> BuiltEngine:
    """The engine for `loaded` as the options say (`kv_scheme`: `kv_scheme_for` its --kv-quant,
    found first so a bad kv_config.json fails before anything else starts). On the thread that
    will own it."""
    from model.engine.engine import Engine
    from model.text.grammar import make_compiler  # structured outputs: None if llguidance is absent

    eos = eos_of(loaded, eos_token_ids)
    spec, label = build_speculation(speculation, loaded.path, kv_quantized=kv_scheme.quantized)
    grammars = make_compiler(loaded.path, vocab_size=int(loaded.config.raw.get("vocab_size") or 0), eos_token_ids=eos)
    built = Engine(
        loaded.model,
        eos_token_ids=eos,
        protected_ids=frozenset(protected_ids),
        prompt_cache=prompt_cache,
        grammar_compiler=grammars,
        options=engine,
        aborts=aborts,
        kv_scheme=kv_scheme,
        speculation=spec,
    )
    return BuiltEngine(built, loaded, kv_scheme, eos, label)

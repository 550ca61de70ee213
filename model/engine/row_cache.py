"""The engine's side of the prompt cache: what a row restores at open and what it puts back.

Keys are exact token tuples, namespaced by the KV scheme's `cache_key` (entries of one scheme
never serve another), and a restore must hold what the row's own cold run would
(`model.kv.rows.restorable`): anything else is a miss, never a different result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from model.kv.cache import PrefixCache, SoloCache
from model.kv.rows import restorable
from model.kv.scheme import KVScheme

if TYPE_CHECKING:
    from model.engine.decoding import Row


def namespaced(scheme: KVScheme, namespace: str) -> str:
    key = scheme.cache_key
    return f"{key}|{namespace}" if key else namespace


def take(
    cache: PrefixCache | None, scheme: KVScheme, row: Row, fresh: list[SoloCache], min_tokens: int = 1
) -> tuple[list[Any], int]:
    """The longest usable cached prefix of the row's prompt as its caches, or `fresh` (the
    model's own per-layer kinds: `LanguageModel.make_caches`)."""
    if cache is not None:
        caches, cached = cache.take(row.key, namespaced(scheme, row.namespace), min_tokens)
        if (
            caches is not None
            and len(caches) == len(fresh)
            and all(c.offset == cached for c in caches)
            and restorable(scheme, caches, cached, row.convert_at)
        ):
            return caches, cached
    return fresh, 0


def put(
    cache: PrefixCache,
    scheme: KVScheme,
    tokens: Sequence[int],
    caches: Sequence[Any],
    namespace: str,
    retain_s: float | None = None,
) -> None:
    """Put caches covering exactly `tokens` (nothing when any layer's coverage differs)."""
    if any(c.offset != len(tokens) for c in caches):
        return
    hint = {} if retain_s is None else {"retain_s": retain_s}  # a hinted put: protected that long
    cache.put(tokens, list(caches), namespaced(scheme, namespace), **hint)


def put_covered(
    cache: PrefixCache, scheme: KVScheme, row: Row, caches: Sequence[Any], retain_s: float | None = None
) -> None:
    """Put a closing row's caches keyed by exactly the tokens they cover (protected from eviction
    for `retain_s` when given)."""
    if not caches:
        return
    covered = caches[0].offset
    known = row.key + row.tokens
    # More KV than known tokens means a forward was fed a token we never read (a step computed
    # ahead after the row finished): its key would be a guess, so no put.
    if covered == 0 or covered > len(known):
        return
    put(cache, scheme, known[:covered], caches, row.namespace, retain_s)

"""GET /v1/models with a model pool (actors/pool.py): every servable model, each with its
`status` ("loaded", "loading" or "unloaded"). A loaded model's card is the one a single-model
server gives (capabilities, context window, defaults: api/openai/routes.py), then its mounted
adapters; a model not loaded has the plain OpenAI card, since what it can do is known only once
it has loaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.handles import ModelPoolView, ServerHandles
from actors.pool_types import PoolEntry
from api.model_names import adapter_model_names, model_not_found

ModelCard = Callable[[ServerHandles, str], dict[str, Any]]
AdapterCard = Callable[[ServerHandles, str, str], dict[str, Any]]


def pool_cards(
    server: ServerHandles, pool: ModelPoolView, model_card: ModelCard, adapter_card: AdapterCard
) -> list[dict[str, Any]]:
    """Every servable model's card, the default first, each loaded one followed by its adapters'."""
    cards = []
    for entry in pool.entries():
        cards.append(_card(server, pool, entry, model_card))
        handles = pool.resident(entry.id) if entry.status == "loaded" else None
        if handles is not None:
            cards += [adapter_card(handles, name, parent) for name, parent in adapter_model_names(handles)]
    return cards


def pool_card(
    server: ServerHandles, pool: ModelPoolView, model_id: str, model_card: ModelCard, adapter_card: AdapterCard
) -> dict[str, Any]:
    """GET /v1/models/{id}: one servable model's card (or a loaded one's adapter's), else 404."""
    for entry in pool.entries():
        if entry.id == model_id:
            return _card(server, pool, entry, model_card)
        handles = pool.resident(entry.id) if entry.status == "loaded" else None
        if handles is not None:
            adapters = dict(adapter_model_names(handles))
            if model_id in adapters:
                return adapter_card(handles, model_id, adapters[model_id])
    found = pool.find(model_id)  # (an alias, or a Hugging Face cache name the listing left out)
    if found is not None and found != model_id:
        return pool_card(server, pool, found, model_card, adapter_card)
    raise model_not_found(server, model_id)


def _card(server: ServerHandles, pool: ModelPoolView, entry: PoolEntry, model_card: ModelCard) -> dict[str, Any]:
    handles = pool.resident(entry.id) if entry.status == "loaded" else None
    if handles is not None:
        card = model_card(handles, entry.id)
    else:
        card = {"id": entry.id, "object": "model", "created": int(server.started_at), "owned_by": "mlx-trio"}
    card["status"] = entry.status
    if entry.error is not None:
        card["error"] = entry.error
    if entry.default:
        card["default"] = True
    return card

"""What one prefill forward holds besides the weights and the KV cache: the transient admission
bills once for the whole server (actors/policy.py), from the chunk in use and the model's shape.

Per chunk token: the residual stream and its normed copies (4 x hidden), the projected queries,
keys and values, and the MLP's gate, up and product (3 x its width; a routed-experts model's
width is its experts' per token); plus float32 attention scores of the chunk against itself
(heads x chunk), which an unfused attention materializes. No logits: a prefill chunk stops
before the head (the last prompt token is fed alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SCORE_BYTES = 4  # attention scores are float32


def prefill_transient_bytes(config: Mapping[str, Any], *, chunk: int, dtype_bytes: int) -> int:
    """The bytes one prefill forward of `chunk` tokens holds at its peak, for a model whose
    config.json is `config` (a multimodal one's text part: `text_config`)."""
    text = {**config, **(config.get("text_config") or {})}
    hidden = int(text.get("hidden_size") or 0)
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    dense = int(text.get("intermediate_size") or 0)
    routed = int(text.get("moe_intermediate_size") or 0) * int(text.get("num_experts_per_tok") or 0)
    mlp = max(dense, routed)
    per_token = dtype_bytes * (4 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * mlp)
    return chunk * (per_token + SCORE_BYTES * heads * chunk)

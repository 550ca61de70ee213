"""The embedded demo model: what `python -m actors.serve` serves when no --model is given.

A tiny qwen3 checkpoint generated on first use instead of shipped, so the server works out of
the box with no download and no checkpoint in the repository. Its weights are engineered so that
greedy decoding answers every chat prompt with DEMO_SCRIPT (one token per piece) and then EOS:
a few sentences saying what it is and how to serve a real model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from model.text.detokenizer import byte_level_decoder

# The name the demo model is logged and served under (its cache directory is named by DEMO_VERSION).
DEMO_MODEL_NAME = "mlx-trio-demo"

# Bump when the script, shape or any written file changes, so an old cached copy is never reused.
DEMO_VERSION = "demo-v2"

# One token per piece; pieces must be unique, hence the varied chunking.
DEMO_SCRIPT = (
    "Hello!",
    " I am the",
    " embedded demo model",
    " of mlx-trio:",
    " a tiny synthetic network",
    " that always says",
    " these same words.",
    " To chat with",
    " a real model,",
    " restart the server",
    " with --model",
    " <path or Hugging Face repo id>",
    ".",
)

_COMPLETE_MARKER = ".complete"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain text to Qwen's tokenizers (special=False); with <think>/</think> present the server
# reports the model as reasoning-capable, as it would for a real Qwen3 checkpoint.
_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_EOS, _PAD = "<|im_end|>", "<|endoftext|>"

_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if messages[0].role == 'system' else '') }}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in (messages[1:] if messages[0].role == 'system' else messages) %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}
"""

# Shape of the network: one layer, one hidden dimension per script state (plus room to spare).
_HIDDEN, _INTERMEDIATE, _HEADS, _KV_HEADS, _HEAD_DIM = 64, 128, 4, 2, 16


def _tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256 byte symbols with no merges (it encodes any text, byte by
    byte), plus the ChatML tokens and one added token per script piece."""
    tok = Tokenizer(models.BPE(vocab=byte_level_decoder(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _MARKERS + DEMO_SCRIPT])
    return tok


def _tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    added = json.loads(tok.to_str())["added_tokens"]
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {
        "bos_token": None,
        "eos_token": _EOS,
        "pad_token": _PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {str(entry["id"]): {k: entry[k] for k in keys} for entry in added},
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _CHAT_TEMPLATE,
    }


def _tensors(vocab: int, script_ids: list[int], eos_id: int) -> dict[str, np.ndarray]:
    """Weights whose greedy next token depends only on the last token.

    Zeroed o_proj and down_proj make the layer an identity on the residual stream (attention and
    the MLP still run, so the engine goes through its full path) and all-ones norms change only
    the scale, so the final hidden state is the last token's embedding. Embedding dimension i is
    a one-hot "state" for script piece i and dimension k for every other token; lm_head maps
    state i to piece i + 1 (the last piece to EOS) and the "other" state to piece 0. The spare
    dimensions carry small noise so keys and values still differ per token.
    """
    rng = np.random.default_rng(0)
    k = len(script_ids)
    state = np.full(vocab, k)
    state[script_ids] = np.arange(k)
    embed = np.zeros((vocab, _HIDDEN), np.float32)
    embed[np.arange(vocab), state] = 4.0
    embed[:, k + 1 :] = rng.standard_normal((vocab, _HIDDEN - k - 1), np.float32) * 0.1
    lm_head = np.zeros((vocab, _HIDDEN), np.float32)
    # After the final norm the state entry is ~8, so the chosen logit is ~30 and all others ~0.
    lm_head[[*script_ids[1:], eos_id, script_ids[0]], np.arange(k + 1)] = 30.0 / np.sqrt(_HIDDEN)

    def random(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f), np.float32) / np.sqrt(in_f)).astype(np.float32)

    q_out, kv_out, p = _HEADS * _HEAD_DIM, _KV_HEADS * _HEAD_DIM, "model.layers.0"
    ones = np.ones(_HIDDEN, np.float32)
    return {
        "model.embed_tokens.weight": embed,
        f"{p}.input_layernorm.weight": ones,
        f"{p}.self_attn.q_proj.weight": random(q_out, _HIDDEN),
        f"{p}.self_attn.k_proj.weight": random(kv_out, _HIDDEN),
        f"{p}.self_attn.v_proj.weight": random(kv_out, _HIDDEN),
        f"{p}.self_attn.o_proj.weight": np.zeros((_HIDDEN, q_out), np.float32),
        f"{p}.self_attn.q_norm.weight": np.ones(_HEAD_DIM, np.float32),
        f"{p}.self_attn.k_norm.weight": np.ones(_HEAD_DIM, np.float32),
        f"{p}.mlp.gate_proj.weight": random(_INTERMEDIATE, _HIDDEN),
        f"{p}.mlp.up_proj.weight": random(_INTERMEDIATE, _HIDDEN),
        f"{p}.mlp.down_proj.weight": np.zeros((_HIDDEN, _INTERMEDIATE), np.float32),
        f"{p}.post_attention_layernorm.weight": ones,
        "model.norm.weight": ones,
        "lm_head.weight": lm_head,
    }


def _config(vocab: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": _HIDDEN,
        "intermediate_size": _INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_model(path: Path) -> Path:
    """Write the demo model's files into `path` (created if missing). Deterministic."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", _tokenizer_config(tok))
    ids = tok.get_vocab(with_added_tokens=True)
    eos, script_ids = ids[_EOS], [ids[piece] for piece in DEMO_SCRIPT]
    vocab = -(-len(ids) // 64) * 64  # padded to a multiple of 64, as real vocabularies are
    save_file(_tensors(vocab, script_ids, eos), str(path / "model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "config.json", _config(vocab, eos))
    _write_json(path / "generation_config.json", {"bos_token_id": None, "eos_token_id": [eos, ids[_PAD]]})
    return path


def cache_root() -> Path:
    """The server's own cache (the demo model, built CUDA kernels): $MLX_TRIO_CACHE or
    ~/.cache/mlx-trio."""
    env = os.environ.get("MLX_TRIO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlx-trio"


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the demo model lives: `<cache_dir>/<DEMO_VERSION>`, cache_dir defaulting to
    `cache_root()`."""
    return Path(cache_dir if cache_dir is not None else cache_root()) / DEMO_VERSION


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file() and all((model_dir / f).is_file() for f in _REQUIRED_FILES)


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model directory, generating it first if it is missing or incomplete.

    Generation writes into a sibling temp dir and renames it into place, so a crash never
    leaves a half-written model that a later start would trust, and two servers starting at
    once both end up with the same complete copy.
    """
    target = demo_model_dir(cache_dir)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=target.parent))
    try:
        write_demo_model(staging)
        (staging / _COMPLETE_MARKER).write_text(DEMO_MODEL_NAME + "\n", encoding="utf-8")
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another process renamed its copy in first; theirs is as good as ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

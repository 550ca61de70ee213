"""Write model directories with synthetic weights, laid out exactly like HF / mlx-community ones.

Test fixtures, the embedded demo model and benchmarks need checkpoints of any shape without
downloading one. The directories use the real config.json keys, tensor names, dtypes, sharding and
mlx-community quantization layout, so whatever loads them (our loader, and mlx-lm as the parity
oracle) goes through the same code paths a real checkpoint would.

Two kinds of weights:

* `write_model_dir` — seeded random weights scaled so tiny models give decisive (no near-tie
  logits) and varied (no single-token loops) greedy output, which token-exact parity, batching
  and cache-equality tests depend on.
* `write_scripted_model_dir` — weights engineered so greedy decoding emits a fixed token script
  and then EOS, whatever the prompt: for the demo model and end-to-end text tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from model.synth_tokenizer import write_tokenizer_files


@attrs.frozen
class FamilySpec:
    model_type: str
    architecture: str
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    tokenizer_kind: str
    # Keys real checkpoints of the family carry that no loader needs; kept for realism.
    extra_config: Mapping[str, Any] = attrs.field(factory=dict)


FAMILIES: Mapping[str, FamilySpec] = {
    "llama": FamilySpec(
        model_type="llama",
        architecture="LlamaForCausalLM",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        tokenizer_kind="bpe",
        extra_config={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    ),
    "mistral": FamilySpec(
        model_type="mistral",
        architecture="MistralForCausalLM",
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        qkv_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        tokenizer_kind="spm",
        extra_config={"sliding_window": None},
    ),
    "qwen2": FamilySpec(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        qkv_bias=True,
        qk_norm=False,
        tie_word_embeddings=True,
        tokenizer_kind="bpe",
        # Qwen2.5 ships a sliding_window value with use_sliding_window false: loaders must
        # honour the flag, not the number.
        extra_config={"use_sliding_window": False, "max_window_layers": 21},
    ),
    "qwen3": FamilySpec(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        qkv_bias=False,
        qk_norm=True,
        tie_word_embeddings=True,
        tokenizer_kind="bpe",
        extra_config={
            "attention_bias": False,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": 28,
        },
    ),
}

LLAMA3_ROPE_SCALING: Mapping[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DTYPES = ("float32", "float16", "bfloat16")

# End-of-turn token first (config.json's eos), then end-of-text (also in generation_config).
_TEMPLATE_END_TOKENS = {
    "chatml": ("<|im_end|>", "<|endoftext|>"),
    "llama3": ("<|eot_id|>", "<|end_of_text|>"),
}
_TEMPLATE_BOS_FALLBACK = {"chatml": "<|endoftext|>", "llama3": "<|begin_of_text|>"}

# Scales of the random init (see _random_tensors for why each is what it is).
_RESIDUAL_GAIN = 4.0
_QK_GAIN = 3.0
_SPECIAL_TOKEN_OUTPUT_SCALE = 0.1
_SCRIPT_LOGIT = 30.0


# -- tokenizer facts ------------------------------------------------------------------------


@attrs.frozen
class TokenizerFacts:
    size: int  # highest id + 1, added tokens included
    special_ids: frozenset[int]
    ids_by_content: Mapping[str, int]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # [0] is the chat template's end-of-turn token

    def id_of(self, content: str) -> int:
        try:
            return self.ids_by_content[content]
        except KeyError:
            raise ValueError(f"token {content!r} is not in the synthetic tokenizer") from None


def read_tokenizer_facts(model_dir: Path, template: str) -> TokenizerFacts:
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    token_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids: dict[str, int] = dict(data["model"]["vocab"])
    special: set[int] = set()
    for entry in data["added_tokens"]:
        ids[entry["content"]] = entry["id"]
        if entry["special"]:
            special.add(entry["id"])

    end_tokens = [t for t in _TEMPLATE_END_TOKENS[template] if t in ids]
    configured_eos = _token_content(token_config.get("eos_token"))
    if configured_eos in ids and configured_eos not in end_tokens:
        end_tokens.insert(0, configured_eos)
    if not end_tokens:
        raise ValueError(f"{model_dir}: tokenizer has no end-of-turn token for template {template!r}")
    bos = _token_content(token_config.get("bos_token")) or _TEMPLATE_BOS_FALLBACK[template]
    return TokenizerFacts(
        size=max(ids.values()) + 1,
        special_ids=frozenset(special),
        ids_by_content=ids,
        bos_token_id=ids.get(bos),
        eos_token_ids=tuple(ids[t] for t in end_tokens),
    )


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


# -- the plan: every shape and key, decided once ------------------------------------------


@attrs.frozen
class Quantization:
    bits: int
    group_size: int
    overrides: Mapping[str, Any]  # module path -> {"group_size", "bits"} or False (keep float)

    def params_for(self, module: str) -> tuple[int, int] | None:
        override = self.overrides.get(module, {"group_size": self.group_size, "bits": self.bits})
        if override is False:
            return None
        return int(override["group_size"]), int(override["bits"])

    def config_entry(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, **self.overrides}


@attrs.frozen
class Plan:
    family: FamilySpec
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    quantization: Quantization | None
    tokens: TokenizerFacts


def _parse_quant(quant: str | None, group_size: int, overrides: Mapping[str, Any] | None) -> Quantization | None:
    if quant is None:
        if overrides:
            raise ValueError("quant_overrides needs quant='q4' or 'q8'")
        return None
    match = re.fullmatch(r"q([2-8])", quant)
    if not match:
        raise ValueError(f"unknown quant {quant!r}; expected None, 'q4' or 'q8'")
    return Quantization(bits=int(match.group(1)), group_size=group_size, overrides=dict(overrides or {}))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# -- tensors ----------------------------------------------------------------------------------


def _linear_modules(plan: Plan) -> list[tuple[str, int, int]]:
    """(module path, out_features, in_features) for every Linear, in checkpoint order."""
    h, q_out, kv_out = (
        plan.hidden_size,
        plan.num_attention_heads * plan.head_dim,
        plan.num_key_value_heads * plan.head_dim,
    )
    modules = []
    for i in range(plan.num_hidden_layers):
        p = f"model.layers.{i}"
        modules += [
            (f"{p}.self_attn.q_proj", q_out, h),
            (f"{p}.self_attn.k_proj", kv_out, h),
            (f"{p}.self_attn.v_proj", kv_out, h),
            (f"{p}.self_attn.o_proj", h, q_out),
            (f"{p}.mlp.gate_proj", plan.intermediate_size, h),
            (f"{p}.mlp.up_proj", plan.intermediate_size, h),
            (f"{p}.mlp.down_proj", h, plan.intermediate_size),
        ]
    return modules


def _random_tensors(plan: Plan, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """float32 weights in checkpoint order.

    Embeddings and lm_head are N(0, 1), so logits have std ~sqrt(hidden): top-1/top-2 gaps of a
    few units rather than hundredths. The residual branches (o_proj, down_proj) get a gain of
    _RESIDUAL_GAIN so each layer's update outweighs the token's own embedding; without it the
    final hidden state stays close to e_t and greedy decoding falls into short loops. Queries
    and keys get _QK_GAIN (through q_norm/k_norm where the family has them): with unit-scale
    scores attention is near-uniform, the context summary barely moves from step to step and
    about one prompt in five settles into repeating one token; sharp attention keeps the output
    moving (measured: >= 21 distinct tokens in 32 over 64 seed/family/prompt runs).
    """

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)

    def norm_weight(size: int) -> np.ndarray:
        # Not exactly ones, so a loader that ignores a norm's weight produces different tokens.
        return (1.0 + normal((size,), 0.05)).astype(np.float32)

    h = plan.hidden_size
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": _embedding_rows(plan, normal((plan.vocab_size, h), 1.0))
    }
    residual_outputs = ("o_proj", "down_proj")
    for i in range(plan.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = norm_weight(h)
        for module, out_f, in_f in _linear_modules(plan)[7 * i : 7 * i + 7]:
            gain = _RESIDUAL_GAIN if module.endswith(residual_outputs) else 1.0
            if module.endswith(("q_proj", "k_proj")) and not plan.family.qk_norm:
                gain = _QK_GAIN
            tensors[f"{module}.weight"] = normal((out_f, in_f), gain / np.sqrt(in_f))
            if plan.family.qkv_bias and module.endswith(("q_proj", "k_proj", "v_proj")):
                tensors[f"{module}.bias"] = normal((out_f,), 0.2)
            if module.endswith("o_proj") and plan.family.qk_norm:
                tensors[f"{p}.self_attn.q_norm.weight"] = norm_weight(plan.head_dim) * _QK_GAIN
                tensors[f"{p}.self_attn.k_norm.weight"] = norm_weight(plan.head_dim) * _QK_GAIN
        tensors[f"{p}.post_attention_layernorm.weight"] = norm_weight(h)
    # Random signs on the final norm turn a tied model's self-logit e_t . (w * e_t) from ~hidden
    # into ~0, another guard against repeating the last token.
    signs = np.where(rng.random(h) < 0.5, -1.0, 1.0).astype(np.float32)
    tensors["model.norm.weight"] = norm_weight(h) * signs
    if not plan.tie_word_embeddings:
        tensors["lm_head.weight"] = _output_rows(plan, normal((plan.vocab_size, h), 1.0))
    else:
        tensors["model.embed_tokens.weight"] = _output_rows(plan, tensors["model.embed_tokens.weight"])
    return tensors


def _embedding_rows(plan: Plan, rows: np.ndarray) -> np.ndarray:
    # Padded ids (past the tokenizer) are zero, as no real checkpoint trains them.
    rows[plan.tokens.size :] = 0.0
    return rows


def _output_rows(plan: Plan, rows: np.ndarray) -> np.ndarray:
    # Shrunk special-token rows keep random models from emitting EOS or chat markers mid-test,
    # so a 32-token generation really is 32 tokens. (Tests that need EOS use a scripted model.)
    special = sorted(plan.tokens.special_ids)
    rows[special] *= _SPECIAL_TOKEN_OUTPUT_SCALE
    rows[plan.tokens.size :] = 0.0
    return rows


def _scripted_tensors(plan: Plan, script_ids: Sequence[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Weights whose greedy next token depends only on the last token.

    Zeroed o_proj and down_proj make every layer an identity on the residual stream (attention
    and MLP still run, so engines exercise their full path), leaving final hidden = embedding of
    the last token. Embedding dim i is a one-hot "state" code for script piece i and dim k for
    every other token; lm_head maps state i to piece i+1 (the last piece to EOS) and the
    "other" state to piece 0. The remaining dims carry small noise so keys/values still differ
    per token.
    """
    tensors = _random_tensors(plan, rng)
    k = len(script_ids)
    other_state = k
    state_of = np.full(plan.vocab_size, other_state)
    state_of[list(script_ids)] = np.arange(k)

    embed = np.zeros((plan.vocab_size, plan.hidden_size), dtype=np.float32)
    embed[np.arange(plan.vocab_size), state_of] = 4.0
    embed[:, k + 1 :] = rng.standard_normal((plan.vocab_size, plan.hidden_size - k - 1), dtype=np.float32) * 0.1
    tensors["model.embed_tokens.weight"] = embed

    successors = list(script_ids[1:]) + [plan.tokens.eos_token_ids[0]]
    lm_head = np.zeros((plan.vocab_size, plan.hidden_size), dtype=np.float32)
    per_unit = _SCRIPT_LOGIT / np.sqrt(plan.hidden_size)
    for state, successor in enumerate(successors):
        lm_head[successor, state] = per_unit
    lm_head[script_ids[0], other_state] = per_unit
    tensors["lm_head.weight"] = lm_head

    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(tensors[name])
        elif name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
    return tensors


# -- serialisation ------------------------------------------------------------------------


def _quantized(plan: Plan, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Replace each quantizable weight by mlx-community's packed weight/scales/biases triple."""
    import mlx.core as mx

    target = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[plan.dtype]
    modules = ["model.embed_tokens"] + [m for m, _, _ in _linear_modules(plan)]
    if not plan.tie_word_embeddings:
        modules.append("lm_head")
    out: dict[str, Any] = dict(tensors)
    for module in modules:
        params = plan.quantization.params_for(module)
        if params is None:
            continue
        group_size, bits = params
        weight = tensors[f"{module}.weight"]
        if weight.shape[-1] % group_size:
            raise ValueError(f"{module}: in_features {weight.shape[-1]} is not a multiple of group_size {group_size}")
        packed, scales, biases = mx.quantize(mx.array(weight).astype(target), group_size=group_size, bits=bits)
        out[f"{module}.weight"] = packed
        out[f"{module}.scales"] = scales
        out[f"{module}.biases"] = biases
    return out


def _cast(tensors: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """Floats to `dtype`; numpy arrays for float32/float16, mlx arrays for bfloat16."""
    import mlx.core as mx

    out = {}
    for name, value in tensors.items():
        if dtype == "bfloat16":
            array = value if isinstance(value, mx.array) else mx.array(value)
            out[name] = array if array.dtype == mx.uint32 else array.astype(mx.bfloat16)
        else:
            array = np.array(value) if isinstance(value, mx.array) else value
            out[name] = array if array.dtype == np.uint32 else array.astype(dtype)
    return out


def _nbytes(value: Any) -> int:
    return int(value.nbytes)


def _split_shards(names: list[str], sizes: Mapping[str, int], shards: int) -> list[list[str]]:
    """Contiguous, roughly equal-byte groups; every shard gets at least one tensor."""
    if shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors over {shards} shards")
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    written = 0
    for index, name in enumerate(names):
        still_needed = shards - len(groups)
        left = len(names) - index
        if groups[-1] and still_needed and (written >= len(groups) * total / shards or left == still_needed):
            groups.append([])
        groups[-1].append(name)
        written += sizes[name]
    return groups


def _save(path: Path, tensors: Mapping[str, Any], dtype: str) -> None:
    metadata = {"format": "pt"}
    if dtype == "bfloat16":
        import mlx.core as mx

        mx.save_safetensors(str(path), dict(tensors), metadata=metadata)
    else:
        from safetensors.numpy import save_file

        save_file(dict(tensors), str(path), metadata=metadata)


def _write_weights(model_dir: Path, tensors: Mapping[str, Any], dtype: str, shards: int) -> None:
    names = list(tensors)
    if shards == 1:
        _save(model_dir / "model.safetensors", tensors, dtype)
        return
    sizes = {name: _nbytes(tensors[name]) for name in names}
    weight_map = {}
    groups = _split_shards(names, sizes, shards)
    for number, group in enumerate(groups, start=1):
        filename = f"model-{number:05d}-of-{shards:05d}.safetensors"
        _save(model_dir / filename, {name: tensors[name] for name in group}, dtype)
        weight_map.update(dict.fromkeys(group, filename))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(model_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _config(
    plan: Plan,
    *,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None,
    max_position_embeddings: int,
    explicit_head_dim: bool,
) -> dict[str, Any]:
    fam = plan.family
    config: dict[str, Any] = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "hidden_size": plan.hidden_size,
        "intermediate_size": plan.intermediate_size,
        "num_hidden_layers": plan.num_hidden_layers,
        "num_attention_heads": plan.num_attention_heads,
        "num_key_value_heads": plan.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": fam.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": dict(rope_scaling) if rope_scaling is not None else None,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": plan.vocab_size,
        "tie_word_embeddings": plan.tie_word_embeddings,
        "bos_token_id": plan.tokens.bos_token_id,
        "eos_token_id": plan.tokens.eos_token_ids[0],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": plan.dtype,
        "transformers_version": "4.51.0",
        **fam.extra_config,
    }
    if fam.model_type == "qwen2":
        config["sliding_window"] = max_position_embeddings
    if explicit_head_dim:
        config["head_dim"] = plan.head_dim
    if plan.quantization is not None:
        config["quantization"] = plan.quantization.config_entry()
        config["quantization_config"] = plan.quantization.config_entry()
    return config


def _generation_config(plan: Plan, defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {"bos_token_id": plan.tokens.bos_token_id, "eos_token_id": list(plan.tokens.eos_token_ids)}
    if defaults:
        config["do_sample"] = True
        config.update(defaults)
    config["transformers_version"] = "4.51.0"
    return config


# -- public API -------------------------------------------------------------------------------


def write_model_dir(
    path: Path | str,
    *,
    family: str = "qwen3",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    dtype: str = "float32",
    quant: str | None = None,
    group_size: int = 64,
    tie_word_embeddings: bool | None = None,
    shards: int = 1,
    seed: int = 0,
    rope_scaling: Mapping[str, Any] | str | None = None,
    rope_theta: float | None = None,
    max_position_embeddings: int = 4096,
    tokenizer_kind: str | None = None,
    template: str = "chatml",
    tokenizer_vocab: int = 512,
    extra_added_tokens: Sequence[str] = (),
    extra_config: Mapping[str, Any] | None = None,
    quant_overrides: Mapping[str, Any] | None = None,
    generation_defaults: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete model directory (config, generation config, tokenizer, weights).

    `vocab_size` defaults to the tokenizer's size rounded up to a multiple of 64, like real
    padded vocabularies. `rope_scaling="llama3"` is shorthand for Llama 3.x's scaling dict.
    `quant_overrides` maps module paths to {"group_size", "bits"} (or False to keep the module
    float), written into config's quantization dict the way mlx-lm's mixed quantization does.
    `generation_defaults` (e.g. {"temperature": 0.7, "top_p": 0.8}) go into generation_config.
    Deterministic: the same arguments give the same bytes.
    """
    return _write(
        path,
        _random_tensors,
        family=family,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        dtype=dtype,
        quant=quant,
        group_size=group_size,
        tie_word_embeddings=tie_word_embeddings,
        shards=shards,
        seed=seed,
        rope_scaling=rope_scaling,
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tokenizer_kind=tokenizer_kind,
        template=template,
        tokenizer_vocab=tokenizer_vocab,
        extra_added_tokens=extra_added_tokens,
        extra_config=extra_config,
        quant_overrides=quant_overrides,
        generation_defaults=generation_defaults,
    )


def write_scripted_model_dir(path: Path | str, script: Sequence[str], **kw: Any) -> Path:
    """Write a model whose greedy output is `script` (one token per piece) and then EOS.

    Holds for any prompt whose last token is not itself a script piece, which every chat
    prompt satisfies (it ends with the assistant header). Each piece becomes an added token, so
    pieces must be unique. Defaults to one layer; the hidden size grows to fit one state per
    piece. Other keyword arguments are write_model_dir's.
    """
    pieces = list(script)
    if not pieces:
        raise ValueError("script must have at least one piece")
    if len(set(pieces)) != len(pieces):
        raise ValueError("script pieces must be unique")
    if kw.get("tie_word_embeddings"):
        raise ValueError("a scripted model needs an untied lm_head")
    kw["tie_word_embeddings"] = False
    kw.setdefault("num_hidden_layers", 1)
    kw["hidden_size"] = max(kw.get("hidden_size", 64), _round_up(len(pieces) + 1, 64))
    kw["extra_added_tokens"] = [*kw.get("extra_added_tokens", ()), *pieces]

    def scripted(plan: Plan, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ids = [plan.tokens.id_of(piece) for piece in pieces]
        clashes = set(ids) & set(plan.tokens.eos_token_ids)
        if clashes or len(set(ids)) != len(ids):
            raise ValueError("script pieces must be distinct tokens and not EOS")
        return _scripted_tensors(plan, ids, rng)

    return _write(path, scripted, **kw)


def _write(path: Path | str, make_tensors: Any, **kw: Any) -> Path:
    # write_model_dir's signature is the one list of arguments and defaults; scripted models reuse it.
    defaults = write_model_dir.__kwdefaults__
    unknown = set(kw) - set(defaults)
    if unknown:
        raise TypeError(f"unknown argument(s) {sorted(unknown)}")
    a = {**defaults, **kw}
    if a["family"] not in FAMILIES:
        raise ValueError(f"unknown family {a['family']!r}; expected one of {sorted(FAMILIES)}")
    if a["dtype"] not in DTYPES:
        raise ValueError(f"unknown dtype {a['dtype']!r}; expected one of {DTYPES}")
    fam = FAMILIES[a["family"]]
    heads, kv_heads = a["num_attention_heads"], a["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    natural_head_dim = a["hidden_size"] // heads
    head_dim = a["head_dim"] or natural_head_dim
    if fam.model_type == "qwen2" and head_dim != natural_head_dim:
        raise ValueError("qwen2 has no head_dim key: head_dim must be hidden_size // num_attention_heads")
    rope_scaling = LLAMA3_ROPE_SCALING if a["rope_scaling"] == "llama3" else a["rope_scaling"]
    if a["shards"] < 1:
        raise ValueError("shards must be >= 1")

    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(
        model_dir,
        kind=a["tokenizer_kind"] or fam.tokenizer_kind,
        vocab_size=a["tokenizer_vocab"],
        template=a["template"],
        extra_added_tokens=a["extra_added_tokens"],
    )
    tokens = read_tokenizer_facts(model_dir, a["template"])
    vocab_size = a["vocab_size"] or _round_up(tokens.size, 64)
    if vocab_size < tokens.size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({tokens.size} ids)")

    plan = Plan(
        family=fam,
        hidden_size=a["hidden_size"],
        num_hidden_layers=a["num_hidden_layers"],
        intermediate_size=a["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        tie_word_embeddings=fam.tie_word_embeddings if a["tie_word_embeddings"] is None else a["tie_word_embeddings"],
        dtype=a["dtype"],
        quantization=_parse_quant(a["quant"], a["group_size"], a["quant_overrides"]),
        tokens=tokens,
    )
    tensors: dict[str, Any] = make_tensors(plan, np.random.default_rng(a["seed"]))
    if plan.quantization is not None:
        tensors = _quantized(plan, tensors)
    _write_weights(model_dir, _cast(tensors, plan.dtype), plan.dtype, a["shards"])

    config = _config(
        plan,
        rope_theta=a["rope_theta"] if a["rope_theta"] is not None else fam.rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=a["max_position_embeddings"],
        explicit_head_dim=fam.model_type in ("qwen3", "llama") or a["head_dim"] is not None,
    )
    config.update(a["extra_config"] or {})
    _write_json(model_dir / "config.json", config)
    _write_json(model_dir / "generation_config.json", _generation_config(plan, a["generation_defaults"]))
    return model_dir

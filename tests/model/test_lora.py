"""LoRA / DoRA adapters (model/lora/mount.py, model/lora/load.py): mlx-lm parity, per-row selection in a
batch, stacking, refusals, unmounting, quantized bases."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load_model as mlx_lm_load_model

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.kv.cache import KVCache
from model.load.loader import load_model
from model.lora import mount as lora
from model.nn.language_model import LanguageModel
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens
from tests.fixtures.lora import write_adapter

PROMPT = [5, 17, 42, 99, 3, 250, 11, 7]
N_TOKENS = 24


def _ours(model: LanguageModel, adapter_dir: Path | None = None, *, compile_decode: bool = False) -> list[int]:
    """Greedy tokens through the engine, with the adapter mounted on it (and then unmounted)."""
    engine = Engine(model, eos_token_ids=[], options=EngineOptions(compile_decode=compile_decode))
    ids: tuple[str, ...] = ()
    if adapter_dir is not None:
        engine.mount_adapter("engine-adapter", str(adapter_dir))
        ids = ("engine-adapter",)
    out = generate_tokens(engine, [RowSpec(0, tuple(PROMPT), SamplingParams(), N_TOKENS, adapters=ids)])[0]
    if ids:
        assert engine.unmount_adapter("engine-adapter")
    return out


def _reference(model_dir: Path, adapter_dir: Path | None) -> list[int]:
    model, _ = mlx_lm_load_model(model_dir)
    if adapter_dir is not None:
        load_adapters(model, str(adapter_dir))
        model.eval()
    return [tok for tok, _ in generate_step(mx.array(PROMPT), model, max_tokens=N_TOKENS)]


def _model_dir(factory, family: str, quant: str | None = None, dtype: str = "float32") -> Path:
    return factory(family, dtype=dtype, quant=quant, **({"hidden_size": 128} if quant else {}))


def _mounted(model_dir: Path, *adapter_dirs: Path) -> tuple[LanguageModel, list[int]]:
    model = load_model(model_dir).model
    indices = [lora.mount(model, lora.load_adapter(d, model, f"ad{i}")) for i, d in enumerate(adapter_dirs)]
    return model, indices


PARITY = [
    # family, quant, dtype, adapter keyword arguments
    ("qwen3", None, "float32", {}),
    ("llama", None, "float32", {"num_layers": 1, "keys": ["self_attn.q_proj", "self_attn.v_proj", "lm_head"]}),
    ("qwen3", "q4", "float32", {}),
    ("qwen3", None, "bfloat16", {"rank": 8, "scale": 10.0, "strength": 0.1}),
    ("qwen3", None, "float32", {"fine_tune_type": "dora"}),
    ("llama", "q4", "float32", {"fine_tune_type": "dora", "keys": ["self_attn.v_proj", "mlp.down_proj"]}),
]


@pytest.mark.parametrize("family,quant,dtype,adapter", PARITY)
def test_greedy_with_adapter_matches_mlx_lm(tiny_model_factory, tmp_path, family, quant, dtype, adapter):
    model_dir = _model_dir(tiny_model_factory, family, quant, dtype)
    adapter_dir = write_adapter(tmp_path / "adapter", model_dir, **adapter)
    got = _ours(load_model(model_dir).model, adapter_dir)
    assert got == _reference(model_dir, adapter_dir)
    assert got != _reference(model_dir, None)  # the adapter matters: the check can fail
    assert len(set(got)) > 4


def test_base_selection_is_the_unadapted_model_bit_for_bit(tiny_model_factory, tmp_path):
    model_dir = _model_dir(tiny_model_factory, "qwen3")
    plain = load_model(model_dir).model
    model, (index,) = _mounted(model_dir, write_adapter(tmp_path / "a", model_dir))
    base_params = dict(tree_flatten(plain.parameters()))
    adapted_params = {k.replace(".base.", "."): v for k, v in tree_flatten(model.parameters())}
    assert adapted_params.keys() == base_params.keys()  # the deltas are not parameters
    assert all(mx.array_equal(adapted_params[k], v).item() for k, v in base_params.items())

    tokens = mx.array([PROMPT, PROMPT[::-1]])
    want = plain.logits(plain(tokens, [KVCache() for _ in plain.layers]))
    for rows in ([], [(), ()]):
        lora.select(model, rows)
        got = model.logits(model(tokens, [KVCache() for _ in model.layers]))
        assert mx.array_equal(got, want).item()
    # Through the engine: base rows on a model with an adapter mounted, and once it is gone
    # (compiled decode again) equal the plain model; the adapter's row does not.
    engine = Engine(model, eos_token_ids=[])
    engine.mount_adapter("b", str(tmp_path / "a"))
    specs = [
        RowSpec(0, tuple(PROMPT), SamplingParams(), N_TOKENS),
        RowSpec(1, tuple(PROMPT), SamplingParams(), N_TOKENS, adapters=("b",)),
    ]
    both = generate_tokens(engine, specs)
    assert both[0] == _ours(plain, compile_decode=True) != both[1]
    assert engine.unmount_adapter("b")
    assert generate_tokens(engine, specs[:1])[0] == both[0]


def _forward(model: LanguageModel, rows: list[tuple[int, ...]], prompts: list[list[int]]) -> tuple[mx.array, ...]:
    """Logits of a [B, L] prefill and of one decode step after it, under a per-row selection."""
    lora.select(model, rows)
    caches = [KVCache() for _ in model.layers]
    prefill = model.logits(model(mx.array(prompts), caches))
    step = model.logits(model(mx.argmax(prefill[:, -1:], axis=-1), caches))
    return prefill, step


@pytest.mark.parametrize("quant", [None, "q4"])
def test_mixed_batch_rows_equal_solo_rows(tiny_model_factory, tmp_path, quant):
    model_dir = _model_dir(tiny_model_factory, "qwen3", quant)
    model, (a, b, d) = _mounted(
        model_dir,
        write_adapter(tmp_path / "a", model_dir, seed=1),
        write_adapter(tmp_path / "b", model_dir, seed=2),
        write_adapter(tmp_path / "d", model_dir, seed=3, fine_tune_type="dora"),
    )
    rows = [(a,), (), (b,), (a,), (a, b), (d,)]
    prompts = [[(i * 31 + j * 7) % 400 + 3 for j in range(12)] for i in range(len(rows))]
    batch = _forward(model, rows, prompts)
    solo = [_forward(model, [r], [p]) for r, p in zip(rows, prompts)]
    for i in range(len(rows)):
        for k in range(2):  # the prefill's logits, then the decode step's
            together, alone = batch[k][i], solo[i][k][0]
            assert mx.allclose(together, alone, rtol=1e-4, atol=1e-4).item()
            assert mx.array_equal(mx.argmax(together, axis=-1), mx.argmax(alone, axis=-1)).item()
    # The rows really differ by adapter: the same prompt under each selection.
    same = _forward(model, [(a,), (), (b,)], [prompts[0]] * 3)[0][:, -1]
    assert not mx.allclose(same[0], same[1]).item() and not mx.allclose(same[1], same[2]).item()


def _merged(model_dir: Path, adapter_dirs: list[Path]) -> LanguageModel:
    """The base model with each adapter's delta added into its float weights by hand."""
    model = load_model(model_dir).model
    for d in adapter_dirs:
        config = json.loads((d / "adapter_config.json").read_text())
        scale = config["lora_parameters"]["scale"]
        arrays = mx.load(str(d / "adapters.safetensors"))
        assert isinstance(arrays, dict)
        weights = dict(tree_flatten(model.parameters()))
        for name, a in arrays.items():
            if name.endswith(".lora_a"):
                module = name[: -len(".lora_a")]
                weights[f"{module}.weight"] = weights[f"{module}.weight"] + scale * (a @ arrays[f"{module}.lora_b"]).T
        model.load_weights(list(weights.items()))
    return model


def test_stacked_adapters_sum_their_deltas(tiny_model_factory, tmp_path):
    model_dir = _model_dir(tiny_model_factory, "llama")
    dirs = [write_adapter(tmp_path / "a", model_dir, seed=3), write_adapter(tmp_path / "b", model_dir, seed=4)]
    model, (a, b) = _mounted(model_dir, *dirs)
    tokens = [PROMPT]
    stacked = _forward(model, [(a, b)], tokens)
    merged = _merged(model_dir, dirs)
    want = merged.logits(merged(mx.array(tokens), [KVCache() for _ in merged.layers]))
    assert mx.allclose(stacked[0], want, rtol=1e-4, atol=1e-4).item()
    assert not mx.allclose(stacked[0], _forward(model, [(a,)], tokens)[0], atol=1e-2).item()

    # One module: base + delta_a + delta_b (one packed product sums them: equal up to rounding).
    wrapper = model.layers[0].self_attn.q_proj
    assert isinstance(wrapper, lora.AdaptedLinear)
    x = mx.random.normal((2, 3, wrapper.base.weight.shape[1]), key=mx.random.key(0))
    want_q = wrapper.base(x)
    for i in (a, b):
        d = lora.mounted(model)[i].modules[(0, "self_attn.q_proj")]
        want_q = want_q + (d.scale * ((x @ d.lora_a) @ d.lora_b)).astype(x.dtype)
    lora.select(model, [(a, b)])
    assert mx.allclose(wrapper(x), want_q, rtol=1e-5, atol=1e-5).item()


def _write_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_refusals_are_clear_value_errors(tiny_model_factory, tmp_path):
    model_dir = _model_dir(tiny_model_factory, "qwen3")
    model = load_model(model_dir).model
    other = tiny_model_factory("qwen3", hidden_size=96)
    with pytest.raises(ValueError, match=r"adapter 'x' does not fit this model: .*q_proj\.lora_a: shape \(96, 4\)"):
        lora.load_adapter(write_adapter(tmp_path / "other", other), model, "x")

    full = write_adapter(tmp_path / "full", model_dir)
    _write_config(full, fine_tune_type="full")
    with pytest.raises(ValueError, match=r"adapter 'f': a full fine-tune"):
        lora.load_adapter(full, model, "f")
    odd = write_adapter(tmp_path / "odd", model_dir)
    _write_config(odd, fine_tune_type="ia3")
    with pytest.raises(ValueError, match=r"\"fine_tune_type\" must be one of lora, dora \(got \"ia3\"\)"):
        lora.load_adapter(odd, model, "o")
    narrow = write_adapter(tmp_path / "narrow", model_dir)  # weights for both layers, config adapts one
    _write_config(narrow, num_layers=1)
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*not a module this adapter's config adapts"):
        lora.load_adapter(narrow, model, "n")
    with pytest.raises(ValueError, match=r"adapter 'm': .* is not a readable adapter directory"):
        lora.load_adapter(tmp_path / "missing", model, "m")

    a = lora.mount(model, lora.load_adapter(write_adapter(tmp_path / "a", model_dir), model, "a"))
    with pytest.raises(ValueError, match="already mounted"):
        lora.mount(model, lora.load_adapter(tmp_path / "a", model, "a"))
    with pytest.raises(ValueError, match="adapter index 7 is not mounted"):
        lora.select(model, [(a,), (7,)])
    dora = write_adapter(tmp_path / "d", model_dir, fine_tune_type="dora")
    d = lora.mount(model, lora.load_adapter(dora, model, "d"))
    with pytest.raises(ValueError) as refused:
        lora.select(model, [(a, d)])
    assert str(refused.value) == "adapter 'd' is a DoRA adapter, which cannot be stacked with another: select it alone"
    lora.select(model, [(a,), (d,), ()])  # side by side is fine
    lora.select(model, [(a,), ()])
    with pytest.raises(ValueError, match=r"forward 1"):  # a forward narrower than the selection
        model(mx.array([PROMPT]), [KVCache() for _ in model.layers])


def test_unmount_frees_and_keeps_the_others(tiny_model_factory, tmp_path):
    model_dir = _model_dir(tiny_model_factory, "qwen3")
    model = load_model(model_dir).model
    first = lora.load_adapter(write_adapter(tmp_path / "a", model_dir, seed=5), model, "a")
    a = lora.mount(model, first)
    b = lora.mount(model, lora.load_adapter(write_adapter(tmp_path / "b", model_dir, seed=6), model, "b"))
    before = _forward(model, [(b,)], [PROMPT])[0]
    gone = weakref.ref(first)
    lora.select(model, [(a,)])
    with pytest.raises(ValueError, match="selected by the current batch"):
        lora.unmount(model, "a")
    lora.select(model, [])
    del first
    assert lora.unmount(model, "a") == a
    gc.collect()
    assert gone() is None  # nothing of the model's still holds the adapter or its arrays
    assert list(lora.mounted(model)) == [b]
    assert mx.array_equal(_forward(model, [(b,)], [PROMPT])[0], before).item()
    with pytest.raises(ValueError, match=f"adapter index {a} is not mounted"):
        lora.select(model, [(a,)])
    with pytest.raises(ValueError, match="'a' is not mounted"):
        lora.unmount(model, "a")
    c = lora.mount(model, lora.load_adapter(tmp_path / "a", model, "a"))
    assert c not in (a, b)  # indices are never reused


def test_uninstall_restores_the_base_modules(tiny_model_factory, tmp_path):
    model_dir = _model_dir(tiny_model_factory, "qwen3", "q4")
    model, _ = _mounted(model_dir, write_adapter(tmp_path / "a", model_dir))
    assert isinstance(model.layers[0].mlp.down_proj, lora.AdaptedLinear)
    lora.uninstall(model)
    assert type(model.layers[0].mlp.down_proj) is nn.QuantizedLinear
    assert lora.installed(model) is None and lora.mounted(model) == {}
    plain = load_model(model_dir).model
    assert _ours(model, None) == _ours(plain, None)

"""Qwen3-MoE (routed experts, model/moe.py): greedy tokens equal mlx-lm's; batched, cache-hit
and compiled-decode rows equal a solo cold eager run; Hugging Face's per-expert layout loads as
the stacked one; a real server answers a chat on it."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
import trio
from safetensors.numpy import load_file, save_file

from cache.prompt_cache import PromptCache
from model.engine.compiled_decode import CompiledDecode
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.errors import ModelLoadError
from model.load.loader import load_model
from model.moe import QuantizedSwitchLinear, SparseMoeBlock, SwitchLinear
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens
from tests.helpers.parity import PROMPTS, ours, reference
from tests.realserver import complete_whole, real_server

MIXED = {"extra_config": {"mlp_only_layers": [1]}}  # layer 1 keeps the dense MLP
Q4 = {"quant": "q4", "group_size": 32, "hidden_size": 128}  # (moe_intermediate_size 32: groups of 32)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


def engine_for(model, **options):
    return Engine(model, eos_token_ids=[], options=EngineOptions(**options))


# -- parity with mlx-lm -------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, Q4, MIXED], ids=["fp32", "q4", "mixed-dense-layer"])
def test_greedy_matches_mlx_lm(tiny_model_factory, kw):
    # PROMPTS[3] (200 tokens x top-2) routes through the sort-by-expert path, the others do not.
    model_dir = tiny_model_factory("qwen3_moe", **kw)
    got, want = ours(model_dir, PROMPTS), reference(model_dir, PROMPTS)
    assert got == want
    assert all(len(set(seq)) > 4 for seq in got)  # not a degenerate repeat: the check can fail


def test_layers_are_moe_where_the_config_says_and_quantized_experts_load(tiny_model_factory):
    layers = load_model(tiny_model_factory("qwen3_moe", **MIXED)).model.layers
    assert isinstance(layers[0].mlp, SparseMoeBlock) and not isinstance(layers[1].mlp, SparseMoeBlock)
    q4 = load_model(tiny_model_factory("qwen3_moe", **Q4)).model.layers[0].mlp
    assert isinstance(q4.switch_mlp.gate_proj, QuantizedSwitchLinear)
    assert (q4.switch_mlp.gate_proj.bits, q4.switch_mlp.gate_proj.group_size) == (4, 32)
    assert (q4.gate.bits, q4.gate.group_size) == (8, 64)  # the config's per-module router override


def test_weights_bytes_counts_every_expert(moe_dir):
    loaded = load_model(moe_dir)
    on_disk = sum(a.nbytes for a in load_file(str(moe_dir / "model.safetensors")).values())
    experts = loaded.model.layers[0].mlp.switch_mlp
    assert isinstance(experts.up_proj, SwitchLinear) and experts.up_proj.weight.shape == (4, 32, 64)
    assert loaded.weights_bytes == on_disk


# -- compiled decode ---------------------------------------------------------------------------


def test_compiled_decode_runs_all_moe_layers_and_equals_eager(moe_dir, tiny_model_factory):
    model = load_model(moe_dir).model
    assert CompiledDecode(model).enabled
    mixed = load_model(tiny_model_factory("qwen3_moe", **MIXED)).model
    assert not CompiledDecode(mixed).enabled  # layers unlike: the eager forward

    specs = [RowSpec(i, tuple(p), SamplingParams(), 24) for i, p in enumerate(PROMPTS[:3])]
    compiled = engine_for(model, compile_decode=True)
    assert compiled._compiled is not None
    assert generate_tokens(compiled, specs) == generate_tokens(engine_for(model, compile_decode=False), specs)


# -- batching --------------------------------------------------------------------------------


def run_row_to_join(engine, s):
    engine.open_row(s)
    while engine.prefill(s.row_id).remaining:
        pass
    return engine.join(s.row_id).token


@pytest.mark.parametrize("kw", [{}, Q4], ids=["fp32", "q4"])
def test_batch_with_a_join_and_a_leave_equals_solo(tiny_model_factory, kw):
    engine = engine_for(load_model(tiny_model_factory("qwen3_moe", **kw)).model, prefill_chunk=16)
    prompts = {1: PROMPTS[0], 2: PROMPTS[1], 3: PROMPTS[2], 4: [9] * 5 + [123, 456, 78], 5: [31, 41, 59, 26]}
    lengths = {r: 10 if r == 2 else 24 for r in prompts}

    def spec(r):
        return RowSpec(r, tuple(prompts[r]), SamplingParams(), lengths[r])

    alone = {r: generate_tokens(engine, [spec(r)])[r] for r in prompts}
    got = {r: [run_row_to_join(engine, spec(r))] for r in (1, 2, 3, 4)}  # unequal lengths: left padding
    live, steps = {1, 2, 3, 4}, 0
    while live:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        if steps == 5:  # a joiner mid-flight; row 2 leaves early
            got[5] = [run_row_to_join(engine, spec(5))]
            live.add(5)
    assert got == alone


def test_a_batch_wide_enough_to_sort_by_expert_equals_solo(moe_dir):
    # 40 rows x top-2 = 80 (token, expert) pairs per decode step: the sorted gather path, which
    # solo decode (2 pairs) never takes.
    engine = engine_for(load_model(moe_dir).model)
    rng = random.Random(7)
    specs = [RowSpec(i, tuple(rng.randrange(3, 500) for _ in range(5 + i % 7)), SamplingParams(), 8) for i in range(40)]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    assert generate_tokens(engine, specs) == alone


# -- prompt cache ------------------------------------------------------------------------------


def test_prompt_cache_hit_equals_a_cold_run(moe_dir):
    model = load_model(moe_dir).model
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(300)]
    follow = prompt[:200] + [rng.randrange(3, 500) for _ in range(37)]  # a suffix of < 32 pairs: unsorted
    cold_engine = engine_for(model, prefill_chunk=64)
    cold = {
        p: generate_tokens(cold_engine, [RowSpec(0, p, SamplingParams(), 12)])[0] for p in map(tuple, (prompt, follow))
    }
    hot = Engine(model, eos_token_ids=[], prompt_cache=PromptCache(1 << 30), options=EngineOptions(prefill_chunk=64))
    for p in (prompt, prompt, follow):
        opened = hot.open_row(RowSpec(0, tuple(p), SamplingParams(), 12))
        out = generate_tokens_after_open(hot)
        assert out == cold[tuple(p)]
    assert opened.cached_tokens == 200
    assert hot.prompt_cache.stats()["hits"] == 2


def generate_tokens_after_open(engine):
    while engine.prefill(0).remaining:
        pass
    out = [engine.join(0)]
    while not out[-1].finish:
        out += engine.step()
    engine.close_row(0, reusable=True)
    return [t.token for t in out]


# -- Hugging Face layout ------------------------------------------------------------------------


def write_hf_layout(stacked_dir, target, drop=None):
    """The stacked checkpoint as Hugging Face ships it: one tensor per expert and projection."""
    target.mkdir()
    for f in stacked_dir.iterdir():
        if f.name != "model.safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for name, array in load_file(str(stacked_dir / "model.safetensors")).items():
        if ".switch_mlp." not in name:
            tensors[name] = array
            continue
        for e in range(array.shape[0]):
            tensors[name.replace(".switch_mlp.", f".experts.{e}.")] = np.ascontiguousarray(array[e])
    if drop:
        del tensors[drop]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_hf_per_expert_layout_loads_as_the_stacked_one(moe_dir, tmp_path):
    hf_dir = write_hf_layout(moe_dir, tmp_path / "hf")
    stacked, per_expert = load_model(moe_dir), load_model(hf_dir)
    from mlx.utils import tree_flatten

    a, b = dict(tree_flatten(stacked.model.parameters())), dict(tree_flatten(per_expert.model.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert per_expert.weights_bytes == stacked.weights_bytes
    assert ours(hf_dir, PROMPTS[:2]) == reference(hf_dir, PROMPTS[:2]) == ours(moe_dir, PROMPTS[:2])


def test_a_missing_expert_is_a_clear_load_error(moe_dir, tmp_path):
    broken = write_hf_layout(moe_dir, tmp_path / "broken", drop="model.layers.1.mlp.experts.3.down_proj.weight")
    with pytest.raises(ModelLoadError, match="experts.3.down_proj.weight"):
        load_model(broken)


# -- a real server -----------------------------------------------------------------------------


async def test_real_server_answers_a_chat_completion(moe_dir):
    body = {"messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": 12, "temperature": 0}
    with trio.fail_after(120):
        async with real_server(moe_dir, batch=4) as server:
            first = await complete_whole(server, body, chat=True)
            again = await complete_whole(server, body, chat=True)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 12
    assert choice["message"]["content"] and choice["message"]["content"] == again["choices"][0]["message"]["content"]


def test_a_model_compiled_decode_refuses_is_not_retried_every_step(tiny_model_factory, monkeypatch):
    """Mixed dense/MoE layers disable compiled decode: the engine asks once, not per step."""
    import model.engine.engine as engine_module

    built = []

    class Counting(CompiledDecode):
        def _read_layers(self) -> None:
            built.append(1)
            super()._read_layers()

    monkeypatch.setattr(engine_module, "CompiledDecode", Counting)
    engine = engine_for(load_model(tiny_model_factory("qwen3_moe", **MIXED)).model)
    generate_tokens(engine, [RowSpec(0, tuple(PROMPTS[0]), SamplingParams(), 16)])
    assert engine._compiled is not None and not engine._compiled.ready() and len(built) == 1

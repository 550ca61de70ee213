"""LoRA adapters in the engine: rows choose adapters per request and decode in one batch (each
equal to its solo run), adapters mount and unmount while rows run, and prompt-cache entries never
cross adapter sets."""

from __future__ import annotations

import pytest

from cache.prompt_cache import PromptCache
from model.engine.compiled_decode import CompiledDecode
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.lora import mount as lora
from model.lora import pack as lora_pack
from model.lora.adapters import AdapterStillLeaving
from model.lora.delta import LORA_AT, LORA_B, a_key
from model.nn.fused_projections import fuse_projections
from model.options import EngineOptions
from tests.engine_helpers import decode_to_the_end, generate_tokens
from tests.fixtures.lora import write_adapter

PROMPTS = [
    [5, 17, 42, 99, 3, 250, 11, 7],
    [300, 2, 77],
    list(range(40, 140, 3)),
    [9] * 5 + [123, 456, 78],
]
N_TOKENS = 20
# The API's and the registry's words too (model/lora/stack.py).
DORA_ALONE = "adapter 'd' is a DoRA adapter, which cannot be stacked with another: select it alone"


@pytest.fixture(scope="module")
def adapters(qwen3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": str(write_adapter(root / "a", qwen3_dir, seed=1)),
        "b": str(write_adapter(root / "b", qwen3_dir, seed=2, keys=["self_attn.q_proj", "mlp.down_proj"])),
    }


def engine_with(qwen3_dir, adapters, **kw):
    engine = Engine(load_model(qwen3_dir).model, eos_token_ids=[], **kw)
    for aid, path in adapters.items():
        engine.mount_adapter(aid, path)
    return engine


def spec(row_id, prompt, adapters=(), n=N_TOKENS):
    return RowSpec(row_id, tuple(prompt), SamplingParams(), n, adapters=tuple(adapters))


def eager_solo_runs(model_dir, paths, choices):
    """Each row's solo tokens on an eager, unfused engine (the reference for compiled batches)."""
    eager = engine_with(model_dir, paths, options=EngineOptions(compile_decode=False))
    specs = [spec(i, PROMPTS[i % len(PROMPTS)], c) for i, c in enumerate(choices)]
    return specs, {s.row_id: generate_tokens(eager, [s])[s.row_id] for s in specs}


def fused_engine(model_dir, paths):
    """A compiled engine on a model whose decode products are fused (the CUDA default)."""
    model = load_model(model_dir).model
    assert fuse_projections(model)
    engine = Engine(model, eos_token_ids=[])
    for aid, path in paths.items():
        engine.mount_adapter(aid, path)
    return engine


CHOICES = [(), ("a",), ("b",), ("a", "b"), ("a",), (), ("b",), ("a",)]  # 8 rows: two adapters, stacked, none


def test_eight_rows_mixing_adapters_equal_their_solo_runs(qwen3_dir, adapters):
    engine = engine_with(qwen3_dir, adapters)
    specs = [spec(i, PROMPTS[i % len(PROMPTS)], CHOICES[i]) for i in range(8)]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    assert alone[0] != alone[1] != alone[2] != alone[3]  # every choice changes the output
    assert generate_tokens(engine, specs) == alone  # joined one by one
    out: dict[int, list[int]] = {}
    for s in specs:  # joined together
        engine.open_row(s)
        while engine.prefill(s.row_id).remaining:
            pass
    for s, t in zip(specs, engine.join_group([s.row_id for s in specs])):
        out[s.row_id] = [] if t is None else [t.token]
    assert decode_to_the_end(engine, out, {s.row_id for s in specs}) == alone
    group = engine_with(qwen3_dir, adapters)
    for s in specs:  # prefilled in one group forward
        group.open_row(s)
    group.prefill_group([s.row_id for s in specs])
    out = {s.row_id: [group.join(s.row_id).token] for s in specs}
    assert decode_to_the_end(group, out, {s.row_id for s in specs}) == alone


def test_mount_and_unmount_while_rows_run(qwen3_dir, adapters):
    engine = engine_with(qwen3_dir, {"a": adapters["a"]})
    alone_a = generate_tokens(engine, [spec(0, PROMPTS[0], ("a",))])[0]
    base = generate_tokens(engine, [spec(1, PROMPTS[1])])[1]
    engine.open_row(spec(0, PROMPTS[0], ("a",)))
    while engine.prefill(0).remaining:
        pass
    got = {0: [engine.join(0).token]}
    assert engine.unmount_adapter("a") is False  # row 0 still uses it: it leaves when the row does
    with pytest.raises(ValueError, match="not mounted"):
        engine.open_row(spec(5, PROMPTS[2], ("a",)))
    info = engine.mount_adapter("b", adapters["b"])  # mounted while row 0 decodes
    assert info.id == "b" and info.rank == 4
    engine.open_row(spec(1, PROMPTS[1]))
    while engine.prefill(1).remaining:
        pass
    got[1] = [engine.join(1).token]
    got = decode_to_the_end(engine, got, {0, 1})
    assert got == {0: alone_a, 1: base}
    assert [i.id for i in engine.adapters.infos()] == ["b"]  # "a" left with its last row
    with pytest.raises(ValueError, match="not mounted"):
        engine.unmount_adapter("a")


def test_prompt_cache_entries_never_cross_adapter_sets(qwen3_dir, adapters):
    engine = engine_with(qwen3_dir, adapters, prompt_cache=PromptCache(1 << 30))
    prompt = [(i * 11) % 400 + 3 for i in range(300)]
    for choice in [(), ("a",), ("b",), ("a", "b")]:
        first = engine.open_row(spec(0, prompt, choice))
        assert first.cached_tokens == 0  # nothing of another set was served
        while engine.prefill(0).remaining:
            pass
        out = decode_to_the_end(engine, {0: [engine.join(0).token]}, {0}, reusable=True)[0]
        engine.close_row(0, reusable=True)
        hit = engine.open_row(spec(1, prompt + out[:5], choice))
        assert hit.cached_tokens >= len(prompt)  # its own set's entry is there
        while engine.prefill(1).remaining:
            pass
        warm = decode_to_the_end(engine, {1: [engine.join(1).token]}, {1})[1]
        cold = Engine(load_model(qwen3_dir).model, eos_token_ids=[])
        for aid in choice:
            cold.mount_adapter(aid, adapters[aid])
        assert warm == generate_tokens(cold, [spec(1, prompt + out[:5], choice)])[1]


def test_bad_adapters_are_refused_with_clear_errors(qwen3_dir, adapters, tmp_path, tiny_model_factory):
    engine = engine_with(qwen3_dir, {"a": adapters["a"]})
    with pytest.raises(ValueError, match="already mounted"):
        engine.mount_adapter("a", adapters["a"])
    other = write_adapter(tmp_path / "other", tiny_model_factory("llama", hidden_size=128, num_attention_heads=2))
    with pytest.raises(ValueError, match="does not fit this model"):
        engine.mount_adapter("other", str(other))
    with pytest.raises(ValueError, match="not mounted"):
        engine.open_row(spec(0, PROMPTS[0], ("missing",)))


def test_a_dora_adapter_is_refused_in_a_stack_when_the_row_opens(qwen3_dir, adapters, tmp_path):
    engine = engine_with(qwen3_dir, {"a": adapters["a"]})
    engine.mount_adapter("d", str(write_adapter(tmp_path / "d", qwen3_dir, seed=5, fine_tune_type="dora")))
    for stack in [("a", "d"), ("d", "a")]:
        with pytest.raises(ValueError) as refused:
            engine.open_row(spec(0, PROMPTS[0], stack))
        assert str(refused.value) == DORA_ALONE
    assert engine.unmount_adapter("d") is True  # the refused rows never counted as its users


def _row_using(engine, row_id, adapter_id):
    engine.open_row(spec(row_id, PROMPTS[0], (adapter_id,)))
    while engine.prefill(row_id).remaining:
        pass
    return {row_id: [engine.join(row_id).token]}


def test_mounting_a_leaving_adapter_again_from_its_path_keeps_it(qwen3_dir, adapters):
    engine = engine_with(qwen3_dir, {"a": adapters["a"]})
    alone = generate_tokens(engine, [spec(0, PROMPTS[0], ("a",))])[0]
    got = _row_using(engine, 0, "a")
    assert engine.unmount_adapter("a") is False
    before = engine.adapters.infos()
    info = engine.mount_adapter("a", adapters["a"])  # the same weights: the unmount is cancelled
    assert info.path == adapters["a"] and [i.id for i in engine.adapters.infos()] == ["a"]
    assert before == []
    got.update(_row_using(engine, 1, "a"))  # new rows may name it again
    assert decode_to_the_end(engine, got, {0, 1}) == {0: alone, 1: alone}
    assert [i.id for i in engine.adapters.infos()] == ["a"]  # its rows closed and it stayed
    assert engine.unmount_adapter("a") is True


def test_mounting_a_leaving_adapter_from_other_weights_waits_for_its_rows(qwen3_dir, adapters, tmp_path):
    copy = write_adapter(tmp_path / "a", qwen3_dir, seed=1)  # a's weights, elsewhere
    engine = engine_with(qwen3_dir, {"a": str(copy)})
    got = _row_using(engine, 0, "a")
    assert engine.unmount_adapter("a") is False
    with pytest.raises(AdapterStillLeaving, match=r"still unmounting: 1 running request\(s\) use it") as other:
        engine.mount_adapter("a", adapters["b"])
    assert other.value.status == 409 and str(copy) in str(other.value)
    write_adapter(copy, qwen3_dir, seed=9)  # retrained in place: the running row keeps the old weights
    with pytest.raises(AdapterStillLeaving, match="changed"):
        engine.mount_adapter("a", str(copy))
    assert engine.adapters.infos() == []
    decode_to_the_end(engine, got, {0})
    assert engine.mount_adapter("a", adapters["b"]).path == adapters["b"]  # gone with its row: free again


def test_bfloat16_rows_mixing_single_adapters_equal_solo(tiny_model_factory, tmp_path):
    """bfloat16 activations and adapters: the packed deltas in half precision."""
    model_dir = tiny_model_factory("qwen3", dtype="bfloat16")
    paths = {
        aid: str(write_adapter(tmp_path / aid, model_dir, seed=i + 3, dtype="bfloat16")) for i, aid in enumerate("ab")
    }
    engine = engine_with(model_dir, paths)
    choices = [(), ("a",), ("b",), ("a",), (), ("b",)]
    specs = [spec(i, PROMPTS[i % len(PROMPTS)], choices[i]) for i in range(len(choices))]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    assert alone[0] != alone[1] != alone[2]
    assert generate_tokens(engine, specs) == alone


def test_mixed_rows_on_an_untied_head_no_adapter_touches(tiny_model_factory, tmp_path):
    """The LM head is wrapped but no adapter adapts it: a mixed batch leaves it the base op."""
    model_dir = tiny_model_factory("llama", tie_word_embeddings=False)
    paths = {aid: str(write_adapter(tmp_path / aid, model_dir, seed=i + 7)) for i, aid in enumerate("ab")}
    engine = engine_with(model_dir, paths)
    specs = [spec(i, PROMPTS[i % len(PROMPTS)], c) for i, c in enumerate([(), ("a",), ("b",), ("a",)])]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    assert generate_tokens(engine, specs) == alone


def test_fused_decode_products_carry_the_adapters(tiny_model_factory, tmp_path):
    """With the decode products fused (the CUDA default), a mixed batch of adapters, a stack and
    none decodes compiled through the fused q/k/v and gate/up products plus their packed deltas,
    and every row equals its solo run on an unfused, eager engine."""
    model_dir = tiny_model_factory("qwen3", dtype="bfloat16")
    paths = {
        "a": str(write_adapter(tmp_path / "a", model_dir, seed=11, dtype="bfloat16")),
        "b": str(write_adapter(tmp_path / "b", model_dir, seed=12, dtype="bfloat16", keys=["self_attn.v_proj"])),
    }
    specs, alone = eager_solo_runs(model_dir, paths, [(), ("a",), ("b",), ("a", "b"), ("a",), ()])
    assert alone[0] != alone[1] != alone[2] != alone[3]
    engine = fused_engine(model_dir, paths)
    model = engine.model
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    width = 1 if a_key() == "_lora_a" else 0  # (A's columns: its second axis, or its first transposed)
    assert attn["_qkv" + a_key()].shape[width] == 3 * attn.q_proj[a_key()].shape[width]
    assert mlp["_gate_up_lora_b"].shape[1] == mlp["_gate_up"].shape[0]
    assert generate_tokens(engine, specs) == alone
    assert engine._compiled is not None and engine._compiled.ready()


def test_remounting_rebuilds_the_compiled_decode(tiny_model_factory, tmp_path):
    """Unmounting an adapter and mounting another of the same shapes (the LM head adapted too)
    must not leave the compiled decode on the first one's arrays; a DoRA row decodes eager."""
    model_dir = tiny_model_factory("llama", tie_word_embeddings=False)
    keys = ["self_attn.q_proj", "mlp.down_proj", "lm_head"]
    a = str(write_adapter(tmp_path / "a", model_dir, seed=21, keys=keys))
    c = str(write_adapter(tmp_path / "c", model_dir, seed=22, keys=keys))
    d = str(write_adapter(tmp_path / "d", model_dir, seed=23, fine_tune_type="dora"))
    want = generate_tokens(engine_with(model_dir, {"c": c}), [spec(0, PROMPTS[2], ("c",))])
    engine = engine_with(model_dir, {"a": a})
    first = generate_tokens(engine, [spec(0, PROMPTS[2], ("a",))])
    assert first != want
    assert engine.unmount_adapter("a")
    engine.mount_adapter("c", c)
    assert generate_tokens(engine, [spec(0, PROMPTS[2], ("c",))]) == want
    engine.mount_adapter("d", d)
    mixed = [spec(0, PROMPTS[2], ("c",)), spec(1, PROMPTS[1], ("d",))]
    dora_alone = generate_tokens(engine, [mixed[1]])
    assert generate_tokens(engine, mixed) == {**want, **dora_alone}
    assert engine._compiled is not None and not engine._compiled.ready()  # (the last batch held a DoRA row)


def test_packed_copies_are_billed_with_the_adapters(qwen3_dir, adapters):
    engine = engine_with(qwen3_dir, adapters)
    state = lora.installed(engine.model)
    assert state is not None and state.packing is not None and state.packing.nbytes > 0
    own = sum(info.nbytes for info in engine.adapters.infos())
    assert engine.adapters.nbytes == own + state.packing.nbytes
    assert engine.unmount_adapter("b")
    state = lora.installed(engine.model)
    assert state is not None and state.packing is not None
    assert engine.adapters.nbytes == engine.adapters.infos()[0].nbytes + state.packing.nbytes
    assert engine.unmount_adapter("a")
    assert lora.installed(engine.model) is None and engine.adapters.nbytes == 0


def test_mounting_keeps_the_base_only_traces(tiny_model_factory, tmp_path, monkeypatch):
    """Mounting another adapter re-reads the layers but does not retrace base-only decode steps
    (their inputs did not change); a step with deltas traces for the new packed shapes."""
    traced: list[int] = []
    original = CompiledDecode._mid_fn

    def counting(self, *args):
        traced.append(1)
        return original(self, *args)

    monkeypatch.setattr(CompiledDecode, "_mid_fn", counting)
    model_dir = tiny_model_factory("llama")
    engine = engine_with(model_dir, {"a": str(write_adapter(tmp_path / "a", model_dir, seed=31))})
    base = generate_tokens(engine, [spec(0, PROMPTS[0])])
    generate_tokens(engine, [spec(1, PROMPTS[0], ("a",))])
    before = len(traced)
    # (rank 12: the packed width grows in both layouts, 4 -> 16 here and 8 -> 16 padded on CUDA)
    engine.mount_adapter("b", str(write_adapter(tmp_path / "b", model_dir, seed=32, rank=12)))
    assert generate_tokens(engine, [spec(2, PROMPTS[0])]) == {2: base[0]}
    assert len(traced) == before
    with_b = generate_tokens(engine, [spec(3, PROMPTS[0], ("b",))])
    assert len(traced) > before and with_b[3] != base[0]


def test_an_adapter_on_one_member_of_a_fused_product(tiny_model_factory, tmp_path):
    """An adapter on q_proj and up_proj only: the fused q/k/v and gate/up products still carry
    those deltas (k, v and gate get zero columns), equal to the separate products."""
    model_dir = tiny_model_factory("qwen3", dtype="bfloat16")
    keys = ["self_attn.q_proj", "mlp.up_proj"]
    paths = {"a": str(write_adapter(tmp_path / "a", model_dir, seed=41, dtype="bfloat16", keys=keys, strength=2.0))}
    eager = engine_with(model_dir, paths, options=EngineOptions(compile_decode=False))
    specs = [spec(i, PROMPTS[i], c) for i, c in enumerate([(), ("a",), ("a",), ()])]
    alone = {s.row_id: generate_tokens(eager, [s])[s.row_id] for s in specs}
    assert alone[1] != generate_tokens(eager, [spec(1, PROMPTS[1])])[1]
    engine = fused_engine(model_dir, paths)
    model = engine.model
    assert "_qkv" + a_key() in model.layers[0].self_attn and "_gate_up" + a_key() in model.layers[0].mlp
    assert generate_tokens(engine, specs) == alone


def test_blocks_no_adapter_reaches_carry_no_delta(tiny_model_factory, tmp_path):
    """mlx_lm.lora adapts the last blocks only: the others get no packed arrays (they cost what the
    base costs), the compiled decode still runs every layer, traced per pair of layer shapes, and
    a mixed batch equals its rows' solo runs on an eager engine."""
    model_dir = tiny_model_factory("qwen3", dtype="bfloat16", num_hidden_layers=3)
    paths = {
        "a": str(write_adapter(tmp_path / "a", model_dir, seed=51, dtype="bfloat16", num_layers=1)),
        "b": str(write_adapter(tmp_path / "b", model_dir, seed=52, dtype="bfloat16", num_layers=2)),
    }
    specs, alone = eager_solo_runs(model_dir, paths, [(), ("a",), ("b",), ("a", "b"), ("b",), ()])
    assert alone[0] != alone[1] != alone[2] != alone[3]
    engine = fused_engine(model_dir, paths)
    first, middle, last = (layer.self_attn for layer in engine.model.layers)
    assert not any(k.startswith("_qkv_lora") for k in first) and LORA_B not in first.o_proj
    assert "_qkv" + a_key() in middle and "_qkv" + a_key() in last
    assert generate_tokens(engine, specs) == alone
    assert engine._compiled is not None and engine._compiled.ready()


def test_the_transposed_layout_of_the_cuda_kernels(tiny_model_factory, tmp_path, monkeypatch):
    """Where the kernels run, A is packed transposed and the width padded to whole groups of 8;
    the generic products on that layout (what larger batches use there) keep every row of a
    mixed batch equal to its solo run, here on the CPU."""
    monkeypatch.setattr(lora_pack, "a_key", lambda: LORA_AT)
    model_dir = tiny_model_factory("qwen3")
    paths = {
        "a": str(write_adapter(tmp_path / "a", model_dir, seed=61, rank=4)),
        "b": str(write_adapter(tmp_path / "b", model_dir, seed=62, rank=6)),
    }
    engine = engine_with(model_dir, paths)
    q = engine.model.layers[0].self_attn.q_proj
    assert q[LORA_AT].shape == (16, q.base.weight.shape[1]) and q[LORA_B].shape[0] == 16  # 4 + 6 -> 16
    specs = [spec(i, PROMPTS[i % len(PROMPTS)], c) for i, c in enumerate([(), ("a",), ("b",), ("a", "b")])]
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    assert alone[0] != alone[1] != alone[2] != alone[3]
    assert generate_tokens(engine, specs) == alone

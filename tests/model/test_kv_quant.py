"""KV quantization (--kv-quant): greedy tokens equal mlx_lm.generate(kv_bits=...) on every family,
rows of a batch (with joins, leaves and rows turning quantized mid-batch) equal the same rows run
alone, a prompt-cache hit equals a cold run, and entries of one scheme never serve another."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from cache.prompt_cache import PromptCache
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.kv import scheme as kv_scheme
from model.kv.cache import KVCache
from model.kv.quant import QuantizedKVCache
from model.kv.rows import restorable
from model.kv.scheme import KVScheme, LayerQuant
from model.load.loader import load_model
from model.options import EngineOptions, KVOptions
from tests.engine_helpers import decode_to_the_end, generate_tokens

PROMPTS = [
    [5, 17, 42, 99, 3, 250, 11, 7],
    [300, 2, 77],
    list(range(40, 140, 3)),
    [(i * 37) % 400 + 3 for i in range(200)],
]
N_TOKENS = 32
# head_dim 64: one quantization group of 64 per head; 2 query heads per KV head (GQA).
SHAPE = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}


def engine_for(model_dir, bits, start, chunk, *, prompt_cache=None):
    loaded = load_model(model_dir).model
    scheme = kv_scheme.uniform(bits, 64, start, len(loaded.layers)) if bits else KVScheme()
    return Engine(
        loaded,
        eos_token_ids=[],
        options=EngineOptions(prefill_chunk=chunk),
        kv_scheme=scheme,
        prompt_cache=prompt_cache,
    )


def reference(model_dir, prompts, bits, start, chunk):
    model, _ = mlx_lm_load_model(model_dir)
    return [
        [
            tok
            for tok, _ in generate_step(
                mx.array(p),
                model,
                max_tokens=N_TOKENS,
                prefill_step_size=chunk,
                kv_bits=bits,
                kv_group_size=64,
                quantized_kv_start=start,
            )
        ]
        for p in prompts
    ]


def solo_runs(engine, prompts):
    return [
        generate_tokens(engine, [RowSpec(i, tuple(p), SamplingParams(), N_TOKENS)])[i] for i, p in enumerate(prompts)
    ]


# (bits, quantized_kv_start, prefill chunk): start 0 turns rows quantized after their first
# chunk; 15/20 during decode for the short prompts and mid-prompt for the long ones; 100 with
# 64-token chunks at a chunk end inside the 200-token prompt.
SETTINGS = [(8, 0, 2048), (4, 20, 2048), (8, 100, 64), (4, 15, 32)]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("bits,start,chunk", SETTINGS)
def test_greedy_equals_mlx_lm_solo_and_batched(tiny_model_factory, family, bits, start, chunk):
    model_dir = tiny_model_factory(family, **SHAPE)
    engine = engine_for(model_dir, bits, start, chunk)
    want = reference(model_dir, PROMPTS, bits, start, chunk)
    assert solo_runs(engine, PROMPTS) == want
    batched = generate_tokens(engine, [RowSpec(i, tuple(p), SamplingParams(), N_TOKENS) for i, p in enumerate(PROMPTS)])
    assert [batched[i] for i in range(len(PROMPTS))] == want
    # The quantization changed something (else the checks above could not fail).
    plain = reference(model_dir, PROMPTS, None, 0, chunk)
    assert plain != want


def test_batch_with_joins_leaves_and_rows_turning_quantized_equals_solo(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3", **SHAPE)
    engine = engine_for(model_dir, 8, 24, 2048)
    lengths = {0: 30, 1: 12, 2: 30, 3: 20, 4: 25}
    prompts = {**dict(enumerate(PROMPTS)), 4: [31, 41, 59, 26, 53, 58, 97]}
    alone = {
        r: generate_tokens(engine, [RowSpec(r, tuple(p), SamplingParams(), lengths[r])])[r] for r, p in prompts.items()
    }
    got: dict[int, list[int]] = {r: [] for r in prompts}
    for r in (0, 1, 2, 3):  # quantized from the start (2, 3) and not yet (0, 1): a mixed batch
        engine.open_row(RowSpec(r, tuple(prompts[r]), SamplingParams(), lengths[r]))
        while engine.prefill(r).remaining:
            pass
        got[r].append(engine.join(r).token)
    live = {0, 1, 2, 3}
    steps = 0
    while live:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        if steps == 6:  # a joiner while row 0 is still full precision and row 1 about to leave
            engine.open_row(RowSpec(4, tuple(prompts[4]), SamplingParams(), lengths[4]))
            while engine.prefill(4).remaining:
                pass
            got[4].append(engine.join(4).token)
            live.add(4)
    assert got == alone


def test_join_group_rows_turn_quantized_in_the_batch(tiny_model_factory):
    model_dir = tiny_model_factory("llama", **SHAPE)
    engine = engine_for(model_dir, 4, 10, 2048)
    specs = [RowSpec(i, tuple(p), SamplingParams(), 20) for i, p in enumerate(PROMPTS)]
    alone = solo_runs(engine, PROMPTS)
    for s in specs:
        engine.open_row(s)
        while engine.prefill(s.row_id).remaining:
            pass
    out = {s.row_id: [] for s in specs}
    for s, t in zip(specs, engine.join_group([s.row_id for s in specs])):
        if t is not None:
            out[s.row_id].append(t.token)
    got = decode_to_the_end(engine, out, {s.row_id for s in specs})
    assert [got[i] for i in range(len(PROMPTS))] == [a[:20] for a in alone]


def test_prompt_cache_hit_equals_cold_and_a_mismatched_entry_is_a_miss(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3", **SHAPE)
    first = [(i * 13) % 400 + 3 for i in range(40)]
    cache = PromptCache(1 << 30)
    warm = engine_for(model_dir, 8, 0, 16, prompt_cache=cache)
    cold = engine_for(model_dir, 8, 0, 16)
    turn1 = generate_tokens(warm, [RowSpec(0, tuple(first), SamplingParams(), 10)], reusable=True)[0]
    second = first + turn1 + [7, 8, 9, 10, 11] * 3
    opened = warm.open_row(RowSpec(1, tuple(second), SamplingParams(), 16))
    assert opened.cached_tokens >= len(first)  # the turn-1 entry turned at 16, as this prompt does
    while warm.prefill(1).remaining:
        pass
    hit = decode_to_the_end(warm, {1: [warm.join(1).token]}, {1})[1]
    assert hit == generate_tokens(cold, [RowSpec(1, tuple(second), SamplingParams(), 16)])[1]
    # A 10-token turn turns quantized at its join (position 10), a 30-token prompt at its first
    # chunk end (16): the short turn's entry cannot stand in for that prefill, so it is a miss.
    short = [(i * 7) % 400 + 3 for i in range(10)]
    turn1 = generate_tokens(warm, [RowSpec(2, tuple(short), SamplingParams(), 4)], reusable=True)[2]
    longer = short + turn1 + list(range(50, 66))
    assert warm.open_row(RowSpec(3, tuple(longer), SamplingParams(), 8)).cached_tokens == 0
    warm.close_row(3)


def test_entries_of_one_scheme_never_serve_another(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3", **SHAPE)
    prompt = tuple((i * 11) % 400 + 3 for i in range(40))
    for writer_bits, reader_bits in ((8, None), (None, 8), (8, 4)):
        cache = PromptCache(1 << 30)
        writer = engine_for(model_dir, writer_bits, 0, 16, prompt_cache=cache)
        reader = engine_for(model_dir, reader_bits, 0, 16, prompt_cache=cache)
        generate_tokens(writer, [RowSpec(0, prompt, SamplingParams(), 4)], reusable=True)
        assert writer.open_row(RowSpec(1, prompt, SamplingParams(), 4)).cached_tokens > 0  # it is there
        writer.close_row(1)
        assert reader.open_row(RowSpec(2, prompt, SamplingParams(), 4)).cached_tokens == 0
        reader.close_row(2)


def test_restorable_rules():
    q8 = LayerQuant(8, 64)
    scheme = KVScheme("8", (q8, q8), start=0)
    full = [KVCache(), KVCache()]
    assert restorable(scheme, full, 10, 16)  # full precision, short of the turning point
    assert restorable(scheme, full, 16, 16)  # exactly there: it turns once restored
    assert not restorable(scheme, full, 20, 16)  # a cold run would be quantized by now
    turned = [QuantizedKVCache(q8, converted_at=16), QuantizedKVCache(q8, converted_at=16)]
    assert restorable(scheme, turned, 30, 16)
    assert not restorable(scheme, turned, 30, 20)  # turned elsewhere: other values
    assert not restorable(scheme, turned, 12, 16)  # trimmed back before it turned
    four = [QuantizedKVCache(LayerQuant(4, 64), converted_at=16)] * 2
    assert not restorable(scheme, four, 30, 16)
    assert not restorable(KVScheme(), turned, 30, None)  # quantized into a full-precision scheme


def test_conversion_point_is_mlx_lm_s():
    scheme = KVScheme("8", (LayerQuant(8, 64),), start=100)
    assert scheme.conversion_point(201, 64) == 128  # the first chunk end at or past start
    assert scheme.conversion_point(120, 64) == 119  # the last partial chunk reaches it
    assert scheme.conversion_point(40, 64) == 100  # decode reaches it
    assert KVScheme("8", (LayerQuant(8, 64),), start=0).conversion_point(1, 64) == 1  # the join
    assert KVScheme("8", (LayerQuant(8, 64),), start=0).conversion_point(30, 16) == 16


def test_per_layer_config_batched_equals_solo_and_differs_from_uniform(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3", **SHAPE)
    config_dir = tmp_path / "with-config"
    config_dir.mkdir()
    for f in model_dir.iterdir():
        (config_dir / f.name).symlink_to(f)
    (config_dir / "kv_config.json").write_text('{"bits": 4, "layers": {"0": null}}')
    loaded = load_model(config_dir).model
    options = KVOptions(kv_quant="config", quantized_kv_start=10)
    scheme = kv_scheme.resolve(options, model_dir=config_dir, num_layers=len(loaded.layers))
    assert scheme.layer(0) is None and scheme.layer(1) == LayerQuant(4, 64)
    assert scheme.label == "mixed (kv_config.json)"
    engine = Engine(loaded, eos_token_ids=[], options=EngineOptions(prefill_chunk=2048), kv_scheme=scheme)
    alone = solo_runs(engine, PROMPTS)
    batched = generate_tokens(engine, [RowSpec(i, tuple(p), SamplingParams(), N_TOKENS) for i, p in enumerate(PROMPTS)])
    assert [batched[i] for i in range(len(PROMPTS))] == alone
    assert alone != solo_runs(engine_for(model_dir, 4, 10, 2048), PROMPTS)  # layer 0 kept full precision


def test_the_cuda_path_dequantizes_and_keeps_the_tokens(tiny_model_factory, monkeypatch):
    """On CUDA attention over quantized KV (prefill chunks and decode) multiplies by dequantized
    K/V (MLX's CUDA quantized_matmul has no kernel for these products): the same tokens, solo and
    batched, here forced on CPU."""
    from model.kv import quant as kv_quant

    model_dir = tiny_model_factory("qwen3", **SHAPE)
    want = reference(model_dir, PROMPTS, 8, 100, 64)  # 64-token chunks after turning at 128
    monkeypatch.setattr(kv_quant, "_cuda", lambda: True)
    engine = engine_for(model_dir, 8, 100, 64)
    assert solo_runs(engine, PROMPTS) == want
    batched = generate_tokens(engine, [RowSpec(i, tuple(p), SamplingParams(), N_TOKENS) for i, p in enumerate(PROMPTS)])
    assert [batched[i] for i in range(len(PROMPTS))] == want

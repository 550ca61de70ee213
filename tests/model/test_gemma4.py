"""Gemma 4 text (per-layer inputs, KV shared across layers, full layers of their own head dim and
proportional RoPE, keys as values, soft-capped logits; sliding layers on rotating caches): greedy
tokens equal mlx-lm's past the window; batched, grouped, speculative, KV-quantized and cache-hit
rows equal a solo cold run; the multimodal "gemma4" checkpoint serves its text part alike;
what is not served is refused at load; a real server answers."""

from __future__ import annotations

import json
import random
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
import trio

from cache.prompt_cache import PromptCache
from model.engine.speculation import Speculation
from model.kv import scheme as kv_scheme
from model.kv.cache import KVCache
from model.kv.rotating import BatchRotatingKVCache, RotatingKVCache
from model.load.errors import ModelLoadError
from model.load.loader import load_model
from tests.engine_helpers import generate_tokens
from tests.helpers.gemma import engine_for, run_cached, run_row_to_join, spec
from tests.helpers.parity import ours, reference
from tests.realserver import complete_whole, real_server

WINDOW = 16  # the fixture's sliding_window
# Layers s s F s s F (every 3rd full); the E2B-like family's last two (s, F) share the KV of
# layers 3 and 2. "gemma4_text_keqv": full layers' keys are their values, nothing shared.
TINY = {"num_hidden_layers": 6, "head_dim": 16}
Q4 = {**TINY, "quant": "q4"}
LONG = [(i * 37) % 400 + 3 for i in range(40)]  # 40 prompt + 32 generated tokens: past the window
PROMPTS = [[5, 17, 42, 99, 3, 250, 11, 7], [300, 2, 77], LONG, [(i * 13) % 400 + 3 for i in range(200)]]
KINDS = [("gemma4_text", TINY), ("gemma4_text", Q4), ("gemma4_text_keqv", TINY), ("gemma4_text_keqv", Q4)]
IDS = ["e2b-fp32", "e2b-q4", "keqv-fp32", "keqv-q4"]


@pytest.fixture(scope="module")
def gemma_dir(tiny_model_factory):
    return tiny_model_factory("gemma4_text", **TINY)


def distinct(seqs):
    return all(len(set(seq)) > 4 for seq in seqs)  # not a degenerate repeat: the checks can fail


# -- parity with mlx-lm -------------------------------------------------------------------------


# The q4 variants (about 5 s each on two cores) run with -m slow; fp32 ones in every run.
WINDOW_KINDS = [
    pytest.param(*kind, id=i, marks=[pytest.mark.slow] if i.endswith("q4") else [])
    for kind, i in zip(KINDS, IDS, strict=True)
]


@pytest.mark.parametrize("family,kw", WINDOW_KINDS)
def test_greedy_matches_mlx_lm_past_the_window(tiny_model_factory, family, kw):
    model_dir = tiny_model_factory(family, **kw)
    got = ours(model_dir, PROMPTS)
    assert got == reference(model_dir, PROMPTS) and distinct(got)
    # Chunked prefill: chunks wider than the window, and chunks after it wrapped.
    assert ours(model_dir, PROMPTS[2:], prefill_chunk=WINDOW + 4) == reference(
        model_dir, PROMPTS[2:], prefill_chunk=WINDOW + 4
    )


def test_the_model_is_what_the_checkpoint_says_and_each_part_matters(gemma_dir, tiny_model_factory):
    model = load_model(gemma_dir).model
    assert [type(c) for c in model.make_caches()] == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache]
    shared = model.layers[5].self_attn
    assert "k_proj" not in shared and "q_proj" in shared  # the checkpoint's unused k/v were dropped
    assert model.layers[5].mlp.gate_proj.weight.shape[0] == 2 * model.layers[0].mlp.gate_proj.weight.shape[0]
    q4 = load_model(tiny_model_factory("gemma4_text", **Q4)).model
    assert isinstance(q4.model.embed_tokens_per_layer, nn.QuantizedEmbedding)
    assert isinstance(q4.layers[0].per_layer_projection, nn.Linear)  # 32 inputs: not a group of 64
    base = generate_tokens(engine_for(model), [spec(0, LONG)])[0]
    model.make_caches = lambda: [KVCache() for _ in range(4)]  # no window: other tokens
    assert generate_tokens(engine_for(model), [spec(0, LONG)])[0] != base
    scaled = load_model(gemma_dir).model
    scaled.layers[4].layer_scalar = mx.ones((1,))  # (the fixture's are below one)
    assert generate_tokens(engine_for(scaled), [spec(0, LONG)])[0] != base


# -- batching ------------------------------------------------------------------------------------


def run_batch_with_joins(engine, prompts, lengths):
    """Rows 1-3 together, 4-6 joining mid-flight (the last into a batch shrunk to one row)."""
    got = {r: [run_row_to_join(engine, spec(r, prompts[r], lengths[r]))] for r in (1, 2, 3)}
    live, steps = {1, 2, 3}, 0
    while live:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        if steps in (5, 12, 30):
            r = {5: 4, 12: 5, 30: 6}[steps]
            got[r] = [run_row_to_join(engine, spec(r, prompts[r], lengths[r]))]
            live.add(r)
    return got


BATCH_PROMPTS = {1: PROMPTS[0], 2: PROMPTS[1], 3: LONG, 4: [9] * 5 + [123, 456, 78], 5: LONG[:23], 6: [31, 41, 59]}
BATCH_LENGTHS = {1: 32, 2: 10, 3: 32, 4: 24, 5: 32, 6: 20}


@pytest.mark.parametrize("family,kw", KINDS, ids=IDS)
def test_batch_with_joins_and_leaves_equals_solo(tiny_model_factory, family, kw):
    engine = engine_for(load_model(tiny_model_factory(family, **kw)).model, options={"prefill_chunk": 16})
    alone = {r: generate_tokens(engine, [spec(r, p, BATCH_LENGTHS[r])])[r] for r, p in BATCH_PROMPTS.items()}
    assert run_batch_with_joins(engine, BATCH_PROMPTS, BATCH_LENGTHS) == alone and distinct(alone.values())


def test_rows_crossing_the_window_solo_and_batched(gemma_dir):
    engine = engine_for(load_model(gemma_dir).model)
    specs = [spec(1, LONG, 48), spec(2, PROMPTS[1], 48)]  # 40 + 48 and 3 + 48 positions: past 16
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    out = {s.row_id: [run_row_to_join(engine, s)] for s in specs}
    for _ in range(40):
        for t in engine.step():
            out[t.row_id].append(t.token)
    sliding = engine._caches[0]
    assert isinstance(sliding, BatchRotatingKVCache)
    assert sliding._idx < 3 * WINDOW + 2  # 80+ positions fed, a bounded number of slots held
    while engine.batch_size:
        for t in engine.step():
            out[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
    assert out == alone and distinct(alone.values())
    assert alone[1][:32] == reference(gemma_dir, [LONG])[0]


def test_a_group_prefill_and_group_join_equal_solo(gemma_dir):
    engine = engine_for(load_model(gemma_dir).model)
    rng = random.Random(3)
    specs = [spec(i, [rng.randrange(3, 500) for _ in range(6 + 9 * i)], 24) for i in range(4)]  # 6..33 tokens
    alone = {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs}
    for s in specs:
        engine.open_row(s)
    engine.prefill_group([s.row_id for s in specs])
    got: dict[int, list[int]] = {s.row_id: [] for s in specs}
    engine.join_group([s.row_id for s in specs])
    while engine.batch_size:
        for t in engine.step():
            got[t.row_id].append(t.token)
            if t.finish:
                engine.close_row(t.row_id)
    assert got == alone


def test_speculative_rows_equal_plain_decoding(gemma_dir):
    model = load_model(gemma_dir).model
    repeating = LONG[:12] * 4  # n-gram drafts to verify (and reject)
    specs = [spec(i, p, 40) for i, p in enumerate([repeating, LONG, PROMPTS[0]])]
    plain = {s.row_id: generate_tokens(engine_for(model), [s])[s.row_id] for s in specs}
    engine = engine_for(model, speculation=Speculation("ngram", 3, always=True))
    assert engine.speculator is not None
    assert {s.row_id: generate_tokens(engine, [s])[s.row_id] for s in specs} == plain  # solo
    assert generate_tokens(engine, specs) == plain  # a merged batch: rejected drafts are holes


def test_kv_quantized_rows_batched_equal_solo(gemma_dir):
    """The full layers' KV quantized (the one shared layer attends over it), rows turning
    quantized mid-batch beside full-precision ones: batched equals solo."""
    model = load_model(gemma_dir).model
    scheme = kv_scheme.uniform(8, 32, 20, len(model.layers))  # 32: the full layers' head dim
    engine = engine_for(model, kv_scheme=scheme, options={"prefill_chunk": 16})
    alone = {r: generate_tokens(engine, [spec(r, p, BATCH_LENGTHS[r])])[r] for r, p in BATCH_PROMPTS.items()}
    plain = engine_for(model, options={"prefill_chunk": 16})
    assert alone != {r: generate_tokens(plain, [spec(r, p, BATCH_LENGTHS[r])])[r] for r, p in BATCH_PROMPTS.items()}
    assert run_batch_with_joins(engine, BATCH_PROMPTS, BATCH_LENGTHS) == alone


# -- prompt cache --------------------------------------------------------------------------------


def test_a_hit_before_the_window_wraps_equals_a_cold_run(gemma_dir):
    model = load_model(gemma_dir).model
    first, follow = PROMPTS[0], PROMPTS[0] + [77, 300, 12, 5, 8] + LONG[:20]
    cold = generate_tokens(engine_for(model), [spec(0, follow)])[0]
    hot = engine_for(model, prompt_cache=PromptCache(1 << 30))
    run_cached(hot, first, 4)  # puts 11 positions: not wrapped
    cached, out = run_cached(hot, follow, 32)
    assert cached == len(first) and out == cold and distinct([out])


def test_a_wrapped_entry_serves_its_exact_tokens_only(gemma_dir):
    model = load_model(gemma_dir).model
    diverging = LONG[:30] + [1, 2, 3]
    cold = {p: generate_tokens(engine_for(model), [spec(0, p)])[0] for p in (tuple(LONG), tuple(diverging))}
    hot = engine_for(model, prompt_cache=PromptCache(1 << 30))
    assert run_cached(hot, LONG, 32) == (0, cold[tuple(LONG)])  # puts 71+ positions: wrapped
    assert run_cached(hot, diverging, 32) == (0, cold[tuple(diverging)])  # would need a trim: a miss
    longer = LONG + cold[tuple(LONG)] + [5, 6]
    cached, out = run_cached(hot, longer, 16)
    assert cached >= 71 and out == generate_tokens(engine_for(model), [spec(0, longer, 16)])[0]


# -- the multimodal checkpoint and refusals -------------------------------------------------------


def as_multimodal(text_dir, tmp_path):
    """The text model as a "gemma4" checkpoint: config nested, `model.language_model.*` weights,
    tower tensors beside them (dropped when loading)."""
    d = tmp_path / "gemma4"
    shutil.copytree(text_dir, d)
    text = json.loads((d / "config.json").read_text())
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    config |= {"vocab_size": text["vocab_size"], "eos_token_id": text["eos_token_id"], "vision_config": {}}
    (d / "config.json").write_text(json.dumps(config))
    weights = {
        k.replace("model.", "model.language_model.", 1): v for k, v in mx.load(str(d / "model.safetensors")).items()
    }
    weights["model.vision_tower.patch_embedder.weight"] = mx.zeros((4, 4))
    weights["model.embed_vision.embedding_projection.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(d / "model.safetensors"), weights)
    return d


def test_the_multimodal_checkpoint_serves_its_text_model(gemma_dir, tmp_path):
    d = as_multimodal(gemma_dir, tmp_path)
    got = ours(d, PROMPTS[:3])
    assert got == reference(d, PROMPTS[:3]) == ours(gemma_dir, PROMPTS[:3])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"enable_moe_block": True, "num_experts": 4}, "enable_moe_block=True is not supported"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' is not supported"),
        ({"num_kv_shared_layers": 4}, "every KV-shared layer needs an earlier unshared layer"),  # F: all shared
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types must name 6 layers"),
    ],
)
def test_what_is_not_served_is_refused_at_load(gemma_dir, tmp_path, change, message):
    d = tmp_path / "m"
    shutil.copytree(gemma_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ModelLoadError, match=message):
        load_model(d)


# -- a real server -------------------------------------------------------------------------------


async def test_real_server_answers_a_chat_completion(gemma_dir):
    body = {"messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": 24, "temperature": 0}
    with trio.fail_after(120):
        async with real_server(gemma_dir, batch=4) as server:
            first = await complete_whole(server, body, chat=True)
            again = await complete_whole(server, body, chat=True)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 24
    assert choice["message"]["content"] and choice["message"]["content"] == again["choices"][0]["message"]["content"]

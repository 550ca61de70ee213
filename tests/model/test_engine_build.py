"""The one engine builder: the engine it builds generates what mlx-lm does, and two engines
built in one process (a model pool's case) run interleaved exactly as each does alone."""

from __future__ import annotations

from mlx_lm import generate, load

from model.engine.build import build_engine, kv_scheme_for
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.engine.speculation_setup import spec_choice
from model.load.loader import load_model
from model.options import EngineOptions, KVOptions, SpeculationOptions
from tests.engine_helpers import generate_tokens

PROMPT = tuple(range(5, 40))


def _built(model_dir, **kv):
    loaded = load_model(model_dir)
    return build_engine(
        loaded,
        engine=EngineOptions(),
        kv_scheme=kv_scheme_for(loaded, KVOptions(**kv)),
        speculation=spec_choice(SpeculationOptions()),
        eos_token_ids=[],
    )


def _greedy(built, n: int = 12, row_id: int = 1) -> list[int]:
    return generate_tokens(built.engine, [RowSpec(row_id, PROMPT, SamplingParams(), n)])[row_id]


def test_the_built_engine_equals_mlx_lm(qwen3_dir):
    built = _built(qwen3_dir)
    assert built.speculation == "" and not built.kv_scheme.quantized and built.eos_token_ids == frozenset()
    model, tokenizer = load(str(qwen3_dir))
    expected = generate(model, tokenizer, list(PROMPT), max_tokens=12)
    assert tokenizer.decode(_greedy(built)) == expected


def test_two_engines_in_one_process_run_interleaved_as_alone(qwen3_dir, llama_dir):
    alone = {"qwen3": _greedy(_built(qwen3_dir)), "llama": _greedy(_built(llama_dir))}
    first, second = _built(qwen3_dir), _built(llama_dir)
    out: dict[str, list[int]] = {"qwen3": [], "llama": []}
    for name, built in (("qwen3", first), ("llama", second)):
        built.engine.open_row(RowSpec(1, PROMPT, SamplingParams(), 12))
        while built.engine.prefill(1).remaining:
            pass
        out[name].append(built.engine.join(1).token)
    while len(out["qwen3"]) < 12 or len(out["llama"]) < 12:
        for name, built in (("qwen3", first), ("llama", second)):
            if len(out[name]) < 12:
                out[name] += [t.token for t in built.engine.step()]
    assert out == alone

"""Synthetic model directories load in mlx-lm (the oracle) and behave as tests need them to."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures.synth import write_model_dir, write_scripted_model_dir

PROMPTS = ("Hello, how are you?", "Write a poem about the sea.", "What is 2 + 2?")


def greedy(model, prompt_ids: list[int], n: int = 32) -> tuple[list[int], list[float]]:
    """Greedy tokens and each step's top-1 minus top-2 logit."""
    cache = make_prompt_cache(model)
    x = mx.array([prompt_ids])
    tokens, gaps = [], []
    for _ in range(n):
        logits = np.array(model(x, cache=cache)[0, -1].astype(mx.float32))
        top2 = np.sort(logits)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        token = int(np.argmax(logits))
        tokens.append(token)
        x = mx.array([[token]])
    return tokens, gaps


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def assert_decisive_and_diverse(model_dir: Path) -> None:
    model, tokenizer = load(str(model_dir))
    eos = set(tokenizer.eos_token_ids)
    all_gaps, outputs = [], []
    for prompt in PROMPTS:
        tokens, gaps = greedy(model, chat_ids(tokenizer, prompt))
        assert not eos & set(tokens), "random models must not stop early"
        assert len(set(tokens)) >= 8, f"{prompt!r} gave a near-constant output {tokens}"
        all_gaps += gaps
        outputs.append(tokens)
    assert len({tuple(t) for t in outputs}) == len(PROMPTS), "output must depend on the prompt"
    assert np.mean(np.array(all_gaps) > 0.05) >= 0.9


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_family_loads_in_mlx_lm_and_generates_varied_text(tiny_model_factory, family):
    assert_decisive_and_diverse(tiny_model_factory(family))


@pytest.mark.parametrize(
    "dtype,quant", [("bfloat16", None), ("float16", None), ("float32", "q4"), ("float32", "q8"), ("bfloat16", "q4")]
)
def test_qwen3_dtypes_and_quantizations_load_and_generate(tiny_model_factory, dtype, quant):
    assert_decisive_and_diverse(tiny_model_factory("qwen3", dtype=dtype, quant=quant))


def test_sharded_dir_matches_single_file_dir(tiny_model_factory):
    single = tiny_model_factory("llama", seed=3)
    sharded = tiny_model_factory("llama", seed=3, shards=3)
    index = read_json(sharded / "model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == (single / "model.safetensors").stat().st_size - _header_bytes(
        single / "model.safetensors"
    )
    assert_decisive_and_diverse(sharded)
    a, tok = load(str(single))
    b, _ = load(str(sharded))
    ids = chat_ids(tok, PROMPTS[0])
    assert greedy(a, ids)[0] == greedy(b, ids)[0]


def _header_bytes(path: Path) -> int:
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_per_module_quant_override_is_applied(tiny_model_factory):
    override = {"model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8}}
    model_dir = tiny_model_factory("qwen3", quant="q4", quant_overrides=override)
    config = read_json(model_dir / "config.json")
    assert config["quantization"] == {"group_size": 64, "bits": 4, **override}
    model, _ = load(str(model_dir))
    down = model.model.layers[0].mlp.down_proj
    assert (down.bits, down.group_size) == (8, 32)
    other = model.model.layers[1].mlp.down_proj
    assert (other.bits, other.group_size) == (4, 64)
    assert_decisive_and_diverse(model_dir)


def test_hf_naming_and_config_conventions(tiny_model_factory):
    from safetensors import safe_open

    qwen2 = tiny_model_factory("qwen2")
    with safe_open(str(qwen2 / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "lm_head.weight" not in names  # tied by default
    llama = tiny_model_factory("llama", template="llama3", rope_scaling="llama3")
    config = read_json(llama / "config.json")
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
    with safe_open(str(llama / "model.safetensors"), "np") as f:
        assert "lm_head.weight" in set(f.keys())
    tok = read_json(llama / "tokenizer.json")
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    gen = read_json(llama / "generation_config.json")
    assert gen["eos_token_id"] == [ids["<|eot_id|>"], ids["<|end_of_text|>"]]
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] > max(ids.values())
    assert_decisive_and_diverse(llama)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_model_dir(tmp_path / "a", seed=7)
    b = write_model_dir(tmp_path / "b", seed=7)
    c = write_model_dir(tmp_path / "c", seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


SCRIPT = ("Alpha", " beta", " gamma!", "\nDelta", " epsilon.")


@pytest.mark.parametrize("template,quant", [("chatml", None), ("llama3", None), ("chatml", "q4")])
def test_scripted_model_emits_its_script_then_eos(tmp_path, template, quant):
    model_dir = write_scripted_model_dir(tmp_path / "scripted", SCRIPT, template=template, quant=quant)
    model, tokenizer = load(str(model_dir))
    for prompt in PROMPTS:
        tokens, gaps = greedy(model, chat_ids(tokenizer, prompt), n=len(SCRIPT) + 1)
        assert tokenizer.decode(tokens[:-1]) == "".join(SCRIPT)
        assert tokens[-1] in tokenizer.eos_token_ids
        assert tokens[-1] == read_json(model_dir / "config.json")["eos_token_id"]
        assert min(gaps) > 1.0


def test_agent_model_answers_calls_and_closes_by_what_the_prompt_holds(tmp_path: Path):
    from mlx_lm import generate

    from tests.fixtures.synth import write_agent_model_dir

    call = ["<tool_call>", '\n{"name": "Read", "arguments": {"file_path": "/w/clue.txt"}}\n', "</tool_call>"]
    model, tok = load(
        str(
            write_agent_model_dir(
                tmp_path, answer=["Hi", " there."], call=call, after_call=["Done", " reading."], call_trigger="clue.txt"
            )
        )
    )

    def reply(messages: list[dict], filler: int = 0) -> str:
        system = [{"role": "system", "content": "word " * filler}] if filler else []
        prompt = tok.apply_chat_template([*system, *messages], add_generation_prompt=True, tokenize=False)
        return generate(model, tok, prompt, max_tokens=16)

    asked = {"role": "user", "content": "Please read clue.txt for me."}
    function = {"name": "Read", "arguments": {"file_path": "/w/clue.txt"}}
    called = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}
    result = {"role": "tool", "content": "the clue"}
    assert reply([{"role": "user", "content": "Say hi."}]) == "Hi there."
    assert reply([asked]) == "".join(call)
    assert reply([asked, called, result]) == "Done reading."
    # the triggers hold across a long context (the rotary pair they use barely turns)
    assert reply([asked, called, result], filler=20000) == "Done reading."
    assert reply([asked], filler=20000) == "".join(call)

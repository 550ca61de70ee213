"""The embedded demo model: written by the shipped package alone, cached, and answering its script."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from model.engine.engine import Engine
from model.engine.rows import RowSpec
from model.engine.sampling import SamplingParams
from model.load.demo import DEMO_MODEL_NAME, DEMO_SCRIPT, DEMO_VERSION, ensure_demo_model, write_demo_model
from model.load.loader import load_model
from model.text.tokenizer import Tokenizer
from tests.engine_helpers import generate_tokens

ANSWER = "".join(DEMO_SCRIPT)

# Chat conversations the demo must answer with its script: plain, multilingual and emoji text,
# text made of script pieces and chat markers, a system prompt, earlier turns.
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Привет, как дела? 你好，世界！ 日本語 😀 🇫🇷 café"}],
    [{"role": "user", "content": "Hello! I am the embedded demo model. <|im_end|> <think>"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))


def test_demo_model_is_deterministic_fast_and_labelled(tmp_path):
    start = time.perf_counter()
    first = ensure_demo_model(tmp_path / "cache-a")
    assert time.perf_counter() - start < 5.0
    second = write_demo_model(tmp_path / "again")
    files = sorted(p.name for p in first.iterdir() if p.is_file() and not p.name.startswith("."))
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert first == tmp_path / "cache-a" / DEMO_VERSION
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path / "cache-a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp, "a complete copy is reused"
    assert "demo" in DEMO_MODEL_NAME


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["hi", "non-ascii", "script-pieces", "multi-turn"])
def test_demo_answers_its_script_then_eos_in_mlx_lm(demo_dir, conversation):
    model, tokenizer = load(str(demo_dir))
    cache = make_prompt_cache(model)
    x = mx.array([tokenizer.apply_chat_template(conversation, add_generation_prompt=True)])
    tokens = []
    for _ in range(len(DEMO_SCRIPT) + 1):
        logits = np.array(model(x, cache=cache)[0, -1].astype(mx.float32))
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1.0, "greedy choice must be decisive"
        tokens.append(int(np.argmax(logits)))
        x = mx.array([[tokens[-1]]])
    assert tokenizer.decode(tokens[:-1]) == ANSWER
    assert tokens[-1] in tokenizer.eos_token_ids


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_demo_answers_its_script_through_our_loader_tokenizer_and_engine(demo_dir, enable_thinking):
    loaded = load_model(demo_dir)
    tokenizer = Tokenizer.from_dir(demo_dir, eos_token_ids_from_config=loaded.config.eos_token_ids)
    assert tokenizer.has_thinking  # reported as reasoning-capable, like a real Qwen3 checkpoint
    engine = Engine(loaded.model, eos_token_ids=tokenizer.eos_token_ids)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    specs = [
        RowSpec(i, tuple(tokenizer.encode_chat(c, **kwargs)), SamplingParams(), max_tokens=100)
        for i, c in enumerate(CONVERSATIONS)
    ]
    for tokens in generate_tokens(engine, specs).values():
        assert tokens[-1] in tokenizer.eos_token_ids, "EOS ends the answer, well before max_tokens"
        assert len(tokens) == len(DEMO_SCRIPT) + 1
        detokenizer = tokenizer.detokenizer()
        for token in tokens[:-1]:
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text == ANSWER
        assert tokenizer.decode(tokens[:-1]) == ANSWER


@pytest.mark.parametrize("damage", ["no marker", "missing weights", "stray directory"])
def test_an_incomplete_copy_is_regenerated(tmp_path, damage):
    target = tmp_path / DEMO_VERSION
    if damage == "stray directory":
        target.mkdir()
        (target / "config.json").write_text("{}")
    else:
        ensure_demo_model(tmp_path)
        (target / (".complete" if damage == "no marker" else "model.safetensors")).unlink()
    assert ensure_demo_model(tmp_path) == target
    reference = write_demo_model(tmp_path / "reference")
    for path in reference.iterdir():
        assert (target / path.name).read_bytes() == path.read_bytes(), path.name
    assert (target / ".complete").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no staging dir left behind"


def test_demo_model_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_TRIO_CACHE", str(tmp_path / "env-cache"))
    assert ensure_demo_model() == tmp_path / "env-cache" / DEMO_VERSION
    assert (tmp_path / "env-cache" / DEMO_VERSION / ".complete").is_file()

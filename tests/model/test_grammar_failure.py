"""A grammar that fails mid-generation ends its row with finish "error" (never "stop" with the
text so far), and a constraint that does not compile on the worker fails the row at open."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llguidance")

from model.engine.engine import Engine  # noqa: E402
from model.engine.params import Constraint, SamplingParams  # noqa: E402
from model.engine.rows import RowSpec, TokenOut  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import EngineOptions  # noqa: E402
from model.text.grammar import GrammarCompiler, GrammarError, RowGrammar  # noqa: E402
from model.text.tokenizer import Tokenizer  # noqa: E402

ONLY_A = Constraint("regex", "a{40}")


class Setup:
    def __init__(self, model_dir):
        loaded = load_model(model_dir)
        self.eos = frozenset(loaded.config.eos_token_ids)
        self.tok = Tokenizer.from_dir(model_dir, eos_token_ids_from_config=self.eos)
        self.compiler = GrammarCompiler.from_model_dir(
            model_dir, vocab_size=loaded.config.raw["vocab_size"], eos_token_ids=self.eos
        )
        self.engine = Engine(
            loaded.model, eos_token_ids=self.eos, grammar_compiler=self.compiler, options=EngineOptions()
        )
        self.prompt = tuple(self.tok.encode("Say a few a's."))
        [self.z] = self.tok.encode("z", add_special_tokens=False)


@pytest.fixture(scope="module")
def qwen(qwen3_dir):
    return Setup(qwen3_dir)


@pytest.fixture
def derail_after(monkeypatch, qwen):
    """From its `k`-th token on, a constrained row's mask allows only "z", which its grammar
    rejects: the matcher fails as on a mid-generation error (a rejected token, an engine limit)."""

    def arm(k: int) -> None:
        original = RowGrammar.mask

        def mask(self: RowGrammar, width: int) -> np.ndarray:
            allowed = original(self, width)
            if self.consumed < k:
                return allowed
            only_z = np.zeros(width, np.bool_)
            only_z[qwen.z] = True
            return only_z

        monkeypatch.setattr(RowGrammar, "mask", mask)

    return arm


def run(engine: Engine, specs: list[RowSpec]) -> dict[int, list[TokenOut]]:
    out: dict[int, list[TokenOut]] = {}
    live = set()
    for spec in specs:
        engine.open_row(spec)
        while engine.prefill(spec.row_id).remaining:
            pass
        first = engine.join(spec.row_id)
        out[spec.row_id] = [first]
        if first.finish:
            engine.close_row(spec.row_id)
        else:
            live.add(spec.row_id)
    steps = 0
    while live:
        for token in engine.step():
            out[token.row_id].append(token)
            if token.finish:
                engine.close_row(token.row_id)
                live.discard(token.row_id)
        steps += 1
        assert steps < 500
    assert engine.active_rows == 0
    return out


@pytest.mark.parametrize("k", [0, 3])  # token 0 comes from the join; later ones from the pipelined step
def test_a_grammar_that_fails_mid_generation_fails_the_row(qwen, derail_after, k):
    derail_after(k)
    free = RowSpec(2, qwen.prompt, SamplingParams(), 12)
    constrained = RowSpec(1, qwen.prompt, SamplingParams(constraint=ONLY_A, temperature=1.0, seed=3), 60)
    out = run(qwen.engine, [constrained, free])
    tokens = out[1]
    *before, last = tokens
    assert [t.finish for t in before] == [None] * k
    assert qwen.tok.decode([t.token for t in before]) == "a" * k  # constrained until the failure
    assert last.finish == "error" and last.token == qwen.z  # ended at the rejected token, not at an EOS after it
    assert last.error is not None and last.error.startswith("the output constraint failed during generation")
    # The free row in the same batch is untouched.
    assert len(out[2]) == 12 and out[2][-1].finish == "length" and all(t.error is None for t in out[2])


def test_a_grammar_that_completes_still_stops(qwen):
    out = run(qwen.engine, [RowSpec(1, qwen.prompt, SamplingParams(constraint=Constraint("regex", "a{3}")), 20)])
    assert [t.finish for t in out[1]][-1] == "stop" and out[1][-1].token in qwen.eos
    assert qwen.tok.decode([t.token for t in out[1][:-1]]) == "aaa"


def test_a_constraint_that_does_not_compile_fails_the_row_at_open(qwen):
    bad = RowSpec(1, qwen.prompt, SamplingParams(constraint=Constraint("regex", "(unclosed")), 8)
    with pytest.raises(GrammarError):
        qwen.engine.open_row(bad)
    assert qwen.engine.active_rows == 0
    run(qwen.engine, [RowSpec(1, qwen.prompt, SamplingParams(), 3)])  # the engine goes on

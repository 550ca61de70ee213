"""Structured outputs enforced inside the batch (model/text/grammar.py + RowSampler + Engine).

Random-weight tiny models emit noise; under a constraint every output must still parse / match.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from model.engine.engine import Engine  # noqa: E402
from model.engine.params import Constraint, SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import EngineOptions  # noqa: E402
from model.text.grammar import GrammarCompiler, GrammarError, RowGrammar, grammar_text, validate  # noqa: E402
from model.text.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2}(\.[0-9])?"
CHOICES = ["yes", "no", "maybe later"]
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?\n'


class Setup:
    def __init__(self, model_dir):
        loaded = load_model(model_dir)
        self.eos = frozenset(loaded.config.eos_token_ids)
        self.tok = Tokenizer.from_dir(model_dir, eos_token_ids_from_config=self.eos)
        self.compiler = GrammarCompiler.from_model_dir(
            model_dir, vocab_size=loaded.config.raw["vocab_size"], eos_token_ids=self.eos
        )
        self.engine = Engine(
            loaded.model,
            eos_token_ids=self.eos,
            grammar_compiler=self.compiler,
            options=EngineOptions(prefill_chunk=16),
        )
        self.prompt = tuple(self.tok.encode("Tell me about yourself in JSON."))

    def text(self, ids):
        return self.tok.decode([i for i in ids if i not in self.eos])


@pytest.fixture(scope="module")
def qwen(qwen3_dir):
    return Setup(qwen3_dir)


@pytest.fixture(scope="module")
def spm(tiny_model_factory):  # SentencePiece-style BPE with byte fallback
    return Setup(tiny_model_factory("llama", tokenizer_kind="spm", template="llama3"))


def run(engine, specs, *, join_after=None):
    """Run rows together; {row_id: (tokens, finish)}. `join_after` = {row_id: steps} delays joins."""
    join_after = join_after or {}
    out, live = {}, set()

    def start(spec):
        engine.open_row(spec)
        while engine.prefill(spec.row_id).remaining:
            pass
        first = engine.join(spec.row_id)
        out[spec.row_id] = ([first.token], first.finish)
        if first.finish:
            engine.close_row(spec.row_id)
        else:
            live.add(spec.row_id)

    waiting = [s for s in specs if s.row_id in join_after]
    for s in specs:
        if s.row_id not in join_after:
            start(s)
    steps = 0
    while live or waiting:
        for s in [s for s in waiting if join_after[s.row_id] <= steps]:
            waiting.remove(s)
            start(s)
        for t in engine.step():
            out[t.row_id][0].append(t.token)
            out[t.row_id] = (out[t.row_id][0], t.finish)
            if t.finish:
                engine.close_row(t.row_id)
                live.discard(t.row_id)
        steps += 1
        assert steps < 5000
    assert engine.active_rows == 0
    return out


def spec(setup, row_id, constraint=None, max_tokens=300, **sampling):
    return RowSpec(row_id, setup.prompt, SamplingParams(constraint=constraint, **sampling), max_tokens)


def json_constraint(schema=SCHEMA, strict=True):
    return Constraint("json_schema", json.dumps(schema), strict=strict)


@pytest.mark.parametrize("which", ["qwen", "spm"])
def test_json_schema_outputs_parse_and_validate(which, request):
    setup = request.getfixturevalue(which)
    specs = [spec(setup, i, json_constraint(), temperature=1.0, seed=100 + i) for i in range(10)]
    specs.append(spec(setup, 99, json_constraint()))  # greedy under a grammar
    out = run(setup.engine, specs)
    texts = set()
    for row_id, (ids, finish) in out.items():
        assert finish == "stop", (row_id, setup.text(ids))
        assert ids[-1] in setup.eos  # the grammar ended: only EOS was allowed
        text = setup.text(ids)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert text == json.dumps(value, ensure_ascii=False)  # compact, OpenAI separators
        texts.add(text)
    assert len(texts) > 3  # sampled rows really differ: the constraint is not a fixed string


def test_json_object_regex_choice_grammar(qwen):
    cases = {
        0: Constraint("json_object"),
        1: Constraint("regex", REGEX),
        2: Constraint("choice", json.dumps(CHOICES)),
        3: Constraint("grammar", EBNF),
        4: Constraint("lark", 'start: "A" /[0-9]{3}/ "Z"'),
    }
    specs = [spec(qwen, r * 10 + s, c, temperature=1.0, seed=s) for r, c in cases.items() for s in range(4)]
    out = run(qwen.engine, specs, join_after={1: 3, 12: 5})
    for row_id, (ids, finish) in out.items():
        kind, text = row_id // 10, qwen.text(ids)
        if kind == 0 and finish == "length":
            continue  # any JSON object may be long; the prefix is still checked below
        assert finish == "stop", (row_id, text)
        if kind == 0:
            assert isinstance(json.loads(text), dict)
        elif kind == 1:
            assert re.fullmatch(REGEX, text, re.ASCII), text
        elif kind == 2:
            assert text in CHOICES
        elif kind == 3:
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text
        else:
            assert re.fullmatch(r"A[0-9]{3}Z", text), text


def test_eight_concurrent_constrained_and_free_rows_equal_solo(qwen):
    rows = {
        1: dict(constraint=json_constraint(), temperature=1.0, seed=7),
        2: dict(),  # free greedy
        3: dict(constraint=Constraint("regex", REGEX)),  # greedy under a grammar
        4: dict(temperature=0.8, top_p=0.9, seed=3),  # free sampled
        5: dict(constraint=Constraint("choice", json.dumps(CHOICES)), temperature=1.0, seed=11),
        6: dict(repetition_penalty=1.3),  # free with a processor
        7: dict(constraint=Constraint("grammar", EBNF), temperature=0.7, seed=5, logprobs=True),
        8: dict(temperature=1.0, seed=9, max_tokens=40),
    }

    def mk(r):
        kw = dict(rows[r])
        return spec(qwen, r, max_tokens=kw.pop("max_tokens", 60), **kw)

    alone = {r: run(qwen.engine, [mk(r)])[r] for r in rows}
    together = run(qwen.engine, [mk(r) for r in rows], join_after={5: 2, 8: 4})
    assert together == alone
    for r in (1, 3, 5, 7):
        assert alone[r][1] == "stop"


def test_grammar_mask_beyond_tokenizer_vocab(tiny_model_factory):
    # A padded vocabulary (model rows past the tokenizer) must never be sampled under a grammar.
    setup = Setup(tiny_model_factory("qwen3", vocab_size=1024))
    assert setup.compiler.vocab_size >= 1024
    out = run(setup.engine, [spec(setup, i, json_constraint(), temperature=1.5, seed=i) for i in range(4)])
    for ids, finish in out.values():
        assert finish == "stop"
        assert max(ids) < setup.tok.vocab_size
        jsonschema.validate(json.loads(setup.text(ids)), SCHEMA)


def test_logprobs_under_a_grammar_are_of_the_masked_distribution(qwen):
    engine = qwen.engine
    engine.open_row(spec(qwen, 1, Constraint("choice", json.dumps(["yes", "no"])), logprobs=True, top_logprobs=3))
    while engine.prefill(1).remaining:
        pass
    first = engine.join(1)
    assert first.logprob is not None and first.logprob > -20  # renormalized over the allowed ids
    allowed = [t for t in first.top_logprobs if t.logprob > -1e9]
    assert allowed and abs(sum(2.718281828**t.logprob for t in allowed) - 1) < 1e-3 or len(allowed) == 3
    for t in allowed:  # every id with probability mass starts one of the choices
        piece = qwen.tok.decode([t.token])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    engine.close_row(1)


def test_compile_is_cached_per_constraint(qwen):
    before = qwen.compiler.compiles
    c = Constraint("regex", r"cache-[0-9]{4}")
    run(qwen.engine, [spec(qwen, i, c, temperature=1.0, seed=i) for i in range(3)])
    run(qwen.engine, [spec(qwen, 7, c)])
    assert qwen.compiler.compiles == before + 1


def test_unenforced_without_a_compiler_runs_free(qwen3_dir):
    loaded = load_model(qwen3_dir)
    engine = Engine(loaded.model, eos_token_ids=loaded.config.eos_token_ids)
    c = Constraint("regex", "x")
    free = run(engine, [RowSpec(1, (5, 6, 7), SamplingParams(), 12)])
    constrained = run(engine, [RowSpec(1, (5, 6, 7), SamplingParams(constraint=c), 12)])
    assert free == constrained  # served, just not enforced (the API adds a Warning header)


def test_row_grammar_observe_is_positional_and_idempotent(qwen):
    g: RowGrammar = qwen.compiler.matcher(Constraint("choice", json.dumps(["ab"])))
    ids = qwen.tok.encode("ab", add_special_tokens=False)
    for i, t in enumerate(ids):
        g.observe(i, t)
        g.observe(i, t)  # reported again by the read after the dispatch: ignored
    assert g.consumed == len(ids) and g.finished and g.error is None
    mask = g.mask(qwen.compiler.vocab_size)
    assert set(mask.nonzero()[0].tolist()) <= set(qwen.eos)
    with pytest.raises(RuntimeError):
        g.observe(len(ids) + 3, 1)


def test_tool_call_constraint_uses_special_token_markers(qwen):
    spec_ = {
        "format": "hermes",
        "tools": [
            {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            }
        ],
    }
    c = Constraint("tool_call", json.dumps(spec_))
    out = run(qwen.engine, [spec(qwen, i, c, temperature=1.0, seed=i) for i in range(4)])
    start_id = qwen.tok.token_to_id("<tool_call>")
    for ids, finish in out.values():
        assert finish == "stop" and ids[0] == start_id  # the special token itself, not its spelling
        text = qwen.tok.decode([i for i in ids if i not in qwen.eos])
        m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.S)
        assert m, text
        call = json.loads(m.group(1))
        assert call["name"] == "get_weather" and set(call["arguments"]) == {"city", "unit"}


def test_invalid_constraints_raise_the_engine_message():
    with pytest.raises(GrammarError, match="objectx"):
        validate(Constraint("json_schema", json.dumps({"type": "objectx"})))
    with pytest.raises(GrammarError, match="unclosed"):
        validate(Constraint("regex", "a(b"))
    with pytest.raises(GrammarError):
        validate(Constraint("grammar", "root ::= missing_rule"))
    with pytest.raises(GrammarError, match="non-empty"):
        grammar_text(Constraint("choice", "[]"))
    validate(Constraint("json_schema", json.dumps(SCHEMA), strict=True))


def _pydantic_like(tag: str, *, recursive: bool = False) -> dict:
    """A parameters schema as pydantic writes one for a nested model: local refs into `$defs`,
    a legacy `definitions` ref, and (`recursive`) a ref to the root, `#`."""
    schema: dict = {
        "type": "object",
        "properties": {"loc": {"$ref": "#/$defs/Loc"}, "unit": {"$ref": "#/definitions/Unit"}},
        "required": ["loc", "unit"],
        "additionalProperties": False,
        "$defs": {
            "Loc": {
                "type": "object",
                "properties": {tag: {"type": "boolean"}},
                "required": [tag],
                "additionalProperties": False,
            }
        },
        "definitions": {"Unit": {"enum": [f"{tag}-c", f"{tag}-f"]}},
    }
    if recursive:
        schema["properties"]["next"] = {"anyOf": [{"type": "null"}, {"$ref": "#"}]}
        schema["required"].append("next")
    return schema


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
def test_tool_call_parameters_with_local_refs(qwen, fmt):
    # Each tool's refs resolve against its own schema, though both name their def "Loc".
    schemas = {"f": _pydantic_like("ok"), "g": _pydantic_like("on")}
    spec_ = {"format": fmt, "tools": [{"name": n, "parameters": s} for n, s in schemas.items()]}
    c = Constraint("tool_call", json.dumps(spec_))
    out = run(qwen.engine, [spec(qwen, i, c, temperature=1.0, seed=i) for i in range(6)])
    opening, closing, args_key, as_list = {
        "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments", False),
        "mistral": ("[TOOL_CALLS]", "", "arguments", True),
        "llama3_json": ("", "", "parameters", False),
    }[fmt]
    for ids, finish in out.values():
        text = qwen.tok.decode([i for i in ids if i not in qwen.eos])
        assert finish == "stop", text
        assert text.startswith(opening) and text.endswith(closing), text
        call = json.loads(text[len(opening) : len(text) - len(closing)])
        if as_list:
            (call,) = call
        jsonschema.validate(call[args_key], schemas[call["name"]])


def test_tool_call_parameters_refs_resolve_in_their_own_tool(qwen):
    # Decided token by token, since a random model always picks the same tool and a recursive
    # schema may nest past any max_tokens.
    tools = [
        {"name": "f", "parameters": _pydantic_like("ok", recursive=True)},
        {"name": "g", "parameters": _pydantic_like("on")},
    ]
    c = Constraint("tool_call", json.dumps({"format": "llama3_json", "tools": tools}))

    def accepts(name: str, arguments: dict) -> bool:
        g = qwen.compiler.matcher(c)
        ids = qwen.tok.encode(json.dumps({"name": name, "parameters": arguments}), add_special_tokens=False)
        for i, t in enumerate(ids):
            g.observe(i, t)
            if g.failed:
                return False
        return g.accepting

    inner = {"loc": {"ok": True}, "unit": "ok-f", "next": None}
    assert accepts("f", {"loc": {"ok": False}, "unit": "ok-c", "next": inner})
    assert not accepts("f", {"loc": {"ok": False}, "unit": "ok-c", "next": {"loc": {"ok": True}}})  # "#": f's root
    assert not accepts("f", {"loc": {"on": False}, "unit": "ok-c", "next": None})  # g's Loc, not f's
    assert accepts("g", {"loc": {"on": False}, "unit": "on-c"})
    assert not accepts("g", {"loc": {"ok": False}, "unit": "on-c"})

"""Tool-call grammars (model/text/tool_grammar.py) walked token by token over a tiny model's
tokenizer (`<tool_call>` and `</tool_call>` are single special tokens there): each format and
mode accepts the calls its markup writes and rejects what breaks them."""

from __future__ import annotations

import json

import pytest

from model.engine.params import Constraint
from model.text import grammar
from model.text.tokenizer import Tokenizer

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"],
}
HERMES = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CODER = (
    "<tool_call>\n<function=weather>\n<parameter=city>\nParis, France\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def walk(qwen3_dir):
    tokenizer = Tokenizer.from_dir(qwen3_dir)
    compiler = grammar.GrammarCompiler.from_model_dir(
        qwen3_dir, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids
    )

    def accepts(fmt: str, mode: str, text: str, *, strict_tool: bool = True) -> bool:
        """Whether the grammar takes `text` whole and may end there."""
        tools = [{"name": "weather", "parameters": SCHEMA, "strict": strict_tool}]
        constraint = Constraint("tool_call", json.dumps({"format": fmt, "mode": mode, "tools": tools}), strict=True)
        grammar.validate(constraint)
        row = compiler.matcher(constraint)
        for index, token in enumerate(tokenizer.encode(text, add_special_tokens=False)):
            if row.finished:  # (only EOS may follow: the text goes on past the grammar)
                return False
            row.observe(index, token)
            if row.failed:
                return False
        return row.accepting

    return accepts


def test_one_and_many_calls(walk):
    assert walk("hermes", "one", HERMES)
    assert not walk("hermes", "one", HERMES + "\n" + HERMES)
    assert walk("hermes", "many", HERMES + "\n" + HERMES)
    assert not walk("hermes", "many", "")
    assert walk("qwen3_coder", "one", CODER) and walk("qwen3_coder", "many", CODER + "\n" + CODER)
    call = '{"name": "weather", "arguments": {"city": "P", "days": 1}}'
    assert walk("mistral", "many", f"[TOOL_CALLS][{call}, {call}]")
    assert not walk("mistral", "one", f"[TOOL_CALLS][{call}, {call}]")


def test_qwen3_coder_values_follow_the_parameter_types(walk):
    assert walk("qwen3_coder", "one", CODER.replace("Paris, France", "Paris,\nmultiline <b>text</b>"))
    assert not walk("qwen3_coder", "one", CODER.replace("Paris, France", "42"))  # would read as a number
    assert not walk("qwen3_coder", "one", CODER.replace("\n3\n", "\nthree\n"))
    optional = CODER.replace("</function>", "<parameter=unit>\nc\n</parameter>\n</function>")
    assert walk("qwen3_coder", "one", optional)
    assert not walk("qwen3_coder", "one", optional.replace("\nc\n", "\nk\n"))
    assert not walk("qwen3_coder", "one", CODER.replace("<parameter=days>\n3\n</parameter>\n", ""))  # required


@pytest.mark.parametrize(("fmt", "call"), [("hermes", HERMES), ("qwen3_coder", CODER)])
def test_lazy_calls_take_free_text_and_constrain_each_call(walk, fmt, call):
    assert walk(fmt, "lazy", "No call needed, just prose.")
    assert walk(fmt, "lazy", f"Let me check. {call} And more: {call} Done.")
    broken = call.replace("3", '"x"') if fmt == "hermes" else call.replace("\n3\n", "\nsoon\n")
    assert not walk(fmt, "lazy", f"Let me check. {broken}")
    assert walk(fmt, "lazy", f"Let me check. {broken}", strict_tool=False)  # not strict: any arguments


def test_a_format_without_a_marker_has_no_lazy_grammar():
    spec = {"format": "llama3_json", "mode": "lazy", "tools": [{"name": "f", "parameters": SCHEMA}]}
    with pytest.raises(grammar.GrammarError, match="no marker"):
        grammar.validate(Constraint("tool_call", json.dumps(spec)))

"""Grammar engines head to head: llguidance vs xgrammar at a ~150k byte-level BPE vocabulary.

Measures, per engine, on the same tokenizer.json:
  * tokenizer preparation (once per model, at worker start),
  * compile time for typical constraints (json_object, small / medium / tool-call JSON schemas,
    a regex, a choice, an EBNF grammar) — cold, i.e. with every cache off or bypassed,
  * mask time per token — the CPU work that must finish before each constrained row samples —
    along (a) a valid answer tokenized by the BPE (the common case: a model that follows the
    grammar) and (b) a random walk that samples uniformly among the allowed tokens (adversarial:
    long strings, odd token boundaries).

No network: the 150k vocabulary is synthesized (byte-level alphabet + prefix-closed merges of
English-like words, numbers, code and JSON punctuation, some CJK), which gives a token trie of
the size and depth of Qwen2's 151k vocab.

  python benchmarks/grammar_engines.py                 # both engines, vocab 150000
  python benchmarks/grammar_engines.py --vocab 32000 --engines llguidance
  python benchmarks/grammar_engines.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

# -- a synthetic Qwen2-sized byte-level BPE ------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_SYL = (
    "a e i o u th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le "
    "ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns ge ly ei os no pe do su "
    "pa ec ac ot di ol tr sh pr pl gr bl cl str ion ment ing tion able ness ful"
).split()
_PUNCT = list("{}[]():;,.\"'!?-_=+*/\\<>|&%$#@~`^") + [
    '":',
    '",',
    '{"',
    '"}',
    '["',
    '"]',
    '":"',
    '": "',
    '", "',
    "\n",
    "\n\n",
    "  ",
    "    ",
    "\t",
    "//",
    "->",
    "=>",
    "==",
    "!=",
]


def synth_vocab_words(size: int, seed: int = 0) -> list[str]:
    """`size` distinct token strings (raw text), prefix-closed so BPE merges can build each."""
    rng = random.Random(seed)
    words: set[str] = set()
    ordered: list[str] = []

    def add(w: str) -> None:
        if w and w not in words:
            words.add(w)
            ordered.append(w)

    for p in _PUNCT:
        add(p)
    for n in range(1000):
        add(str(n))
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    for c in cjk:
        add(c)
    while len(ordered) < size:
        kind = rng.random()
        if kind < 0.75:
            w = "".join(rng.choice(_SYL) for _ in range(rng.choice((1, 2, 2, 3, 3, 4, 5))))
            if rng.random() < 0.15:
                w = w.capitalize()
            if rng.random() < 0.6:
                w = " " + w
        elif kind < 0.85:
            w = rng.choice(("_", ".", "(", '"', " ", "  ")) + "".join(
                rng.choice(_SYL) for _ in range(rng.randint(1, 3))
            )
        elif kind < 0.92:
            w = "".join(rng.choice(cjk) for _ in range(rng.randint(2, 3)))
        else:
            w = rng.choice(_PUNCT) + rng.choice(_PUNCT)
        add(w)
    return ordered[:size]


def synth_tokenizer_json(vocab_size: int = 150_000, *, seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json (GPT-2/Qwen style) with about `vocab_size` ids + specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    for word in synth_vocab_words(vocab_size * 2, seed):
        if len(vocab) >= vocab_size - 3:
            break
        enc = "".join(b2u[b] for b in word.encode("utf-8"))
        # Prefix-closed: enc[:k] = enc[:k-1] + enc[k-1], each prefix a token of its own.
        for k in range(2, len(enc) + 1):
            piece = enc[:k]
            if piece not in vocab:
                merges.append((enc[: k - 1], enc[k - 1]))
                vocab[piece] = len(vocab)
            if len(vocab) >= vocab_size - 3:
                break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )
    return tok.to_str()


# -- the constraints ---------------------------------------------------------------------------------

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SMALL_VALUE = {"name": "Alice Johnson", "age": 42, "email": "alice@example.com", "tags": ["a", "c"]}

MEDIUM_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
        "title": {"type": "string", "maxLength": 80},
        "status": {"type": "string", "enum": ["open", "closed", "pending", "archived"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "score": {"type": "number"},
        "done": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "team": {"type": ["string", "null"]},
            },
            "required": ["name", "email", "team"],
            "additionalProperties": False,
        },
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "subtasks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "done": {"type": "boolean"},
                    "estimate": {"type": "number"},
                },
                "required": ["title", "done"],
                "additionalProperties": False,
            },
        },
        "created": {"type": "string"},
    },
    "required": ["id", "title", "status", "priority", "score", "done", "owner", "labels", "subtasks", "created"],
    "additionalProperties": False,
}
MEDIUM_VALUE = {
    "id": "3fa85f64",
    "title": "Fix the flaky scheduler test",
    "status": "open",
    "priority": 2,
    "score": 0.75,
    "done": False,
    "owner": {"name": "Bob", "email": "bob@example.com", "team": None},
    "labels": ["bug", "ci", "scheduler"],
    "subtasks": [{"title": "reproduce", "done": True, "estimate": 1.5}, {"title": "patch", "done": False}],
    "created": "2025-01-31T12:30:45Z",
}

TOOL_SCHEMA = {  # an OpenAI-style forced function call: {"name": const, "arguments": {...}}
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_VALUE = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}

REGEX = r"\d{3}-\d{3}-\d{4}( ext\. \d{1,5})?"
REGEX_VALUE = "415-555-0123 ext. 42"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
EBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EBNF_VALUE = "(12+7)*3-42/(6+1)"

CASES: list[tuple[str, str, Any, str]] = [
    # (name, kind, spec, a valid output)
    ("json_object", "json_object", None, json.dumps({"a": 1, "b": [True, None], "c": "x"})),
    ("schema_small", "json_schema", SMALL_SCHEMA, json.dumps(SMALL_VALUE)),
    ("schema_medium", "json_schema", MEDIUM_SCHEMA, json.dumps(MEDIUM_VALUE)),
    ("schema_tool_call", "json_schema", TOOL_SCHEMA, json.dumps(TOOL_VALUE)),
    ("regex_phone", "regex", REGEX, REGEX_VALUE),
    ("choice", "choice", CHOICES, "mixed feelings"),
    ("ebnf_arith", "grammar", EBNF, EBNF_VALUE),
]

COMPACT = (", ", ": ")


# -- engine adapters ---------------------------------------------------------------------------------


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        import llguidance

        self.ll = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.prepare_s = time.perf_counter() - t0
        self.words = (vocab_size + 31) // 32
        self.vocab_size = vocab_size

    def grammar(self, kind: str, spec: Any) -> str:
        M = self.ll.LLMatcher
        opts = {"whitespace_flexible": False, "item_separator": COMPACT[0], "key_separator": COMPACT[1]}
        if kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, overrides=opts)
        if kind == "json_schema":
            return M.grammar_from_json_schema(spec, overrides=opts)
        if kind == "regex":
            return M.grammar_from_regex(spec)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "grammar":
            return self.ll.grammar_from("ebnf", spec)
        raise ValueError(kind)

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.ll.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def first_mask_included(self) -> bool:
        return True

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def new_mask(self) -> np.ndarray:
        return np.zeros(self.words, dtype=np.int32)

    def fill(self, m: Any, mask: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped()

    def accepting(self, m: Any) -> bool:
        return m.is_accepting()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tokenizer_json)
        t0 = time.perf_counter()
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for piece, i in vocab.items():
            if i < vocab_size:
                encoded[i] = piece
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=eos)
        self.prepare_s = time.perf_counter() - t0
        self.threads = os.cpu_count() or 1
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: Any) -> Any:
        c = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=COMPACT, strict_mode=True)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        if kind == "grammar":
            return c.compile_grammar(spec)
        raise ValueError(kind)

    def first_mask_included(self) -> bool:
        return False

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self) -> Any:
        return self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, m: Any, mask: Any) -> None:
        m.fill_next_token_bitmask(mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()

    def accepting(self, m: Any) -> bool:
        return m.is_completed() if hasattr(m, "is_completed") else False


def _allowed(mask: Any, vocab: int) -> np.ndarray:
    words = np.asarray(mask).reshape(-1).astype(np.int32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_engine(
    engine: Any, backend: Any, eos: list[int], *, repeats: int, walk_steps: int, seed: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"prepare_tokenizer_ms": engine.prepare_s * 1e3, "cases": {}}
    rng = random.Random(seed)
    for name, kind, spec, valid in CASES:
        row: dict[str, Any] = {}
        compile_ms = []
        compiled = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = engine.compile(kind, spec)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        row["compile_ms"] = statistics.median(compile_ms)
        # First mask of a fresh matcher: llguidance builds lexer states lazily here.
        m = engine.matcher(compiled)
        mask = engine.new_mask()
        t0 = time.perf_counter()
        engine.fill(m, mask)
        row["first_mask_ms"] = (time.perf_counter() - t0) * 1e3

        # (a) a valid answer, tokenized by the model's BPE
        ids = backend.encode(valid, add_special_tokens=False).ids
        times = []
        for _ in range(repeats):
            m = engine.matcher(compiled)
            for tok in ids:
                t0 = time.perf_counter()
                engine.fill(m, mask)
                times.append((time.perf_counter() - t0) * 1e6)
                if not engine.accept(m, tok):
                    raise RuntimeError(f"{engine.name}/{name}: valid token {tok} rejected")
        row["trace_tokens"] = len(ids)
        row["trace_mask_us_mean"] = statistics.fmean(times)
        row["trace_mask_us_p50"] = _pct(times, 0.5)
        row["trace_mask_us_p99"] = _pct(times, 0.99)

        # (b) random walk among allowed tokens (never EOS unless it is all that is left)
        times = []
        m = engine.matcher(compiled)
        for _ in range(walk_steps):
            t0 = time.perf_counter()
            engine.fill(m, mask)
            times.append((time.perf_counter() - t0) * 1e6)
            allowed = [t for t in _allowed(mask, engine.vocab_size).tolist() if t not in eos]
            if not allowed or engine.done(m):
                m = engine.matcher(compiled)
                continue
            if not engine.accept(m, rng.choice(allowed)):
                raise RuntimeError(f"{engine.name}/{name}: allowed token rejected")
            if engine.done(m):
                m = engine.matcher(compiled)
        row["walk_mask_us_mean"] = statistics.fmean(times)
        row["walk_mask_us_p99"] = _pct(times, 0.99)
        out["cases"][name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--walk-steps", type=int, default=300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    tj = synth_tokenizer_json(args.vocab)
    backend = Tokenizer.from_str(tj)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    eos = [backend.token_to_id("<|endoftext|>"), backend.token_to_id("<|im_end|>")]
    print(f"synthetic byte-level BPE: {vocab} ids ({time.perf_counter() - t0:.1f}s to build); cpus={os.cpu_count()}")
    results: dict[str, Any] = {"vocab": vocab, "cpus": os.cpu_count()}
    engines: dict[str, Callable[..., Any]] = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine}
    for name in args.engines.split(","):
        try:
            engine = engines[name](tj, vocab, eos)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        r = bench_engine(engine, backend, eos, repeats=args.repeats, walk_steps=args.walk_steps, seed=0)
        results[name] = r
        print(f"\n== {name}: tokenizer prep {r['prepare_tokenizer_ms']:.0f} ms")
        print(
            f"{'case':18s} {'compile ms':>10s} {'1st mask ms':>11s} {'trace us/tok':>12s} {'p99':>8s} "
            f"{'walk us/tok':>11s} {'p99':>8s}"
        )
        for case, c in r["cases"].items():
            print(
                f"{case:18s} {c['compile_ms']:10.2f} {c['first_mask_ms']:11.2f} {c['trace_mask_us_mean']:12.1f} "
                f"{c['trace_mask_us_p99']:8.1f} {c['walk_mask_us_mean']:11.1f} {c['walk_mask_us_p99']:8.1f}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Per-token cost of grammar-constrained decoding vs free decoding, through the real Engine.

Rows share the batch: at c=8 the "mixed" case runs 4 constrained + 4 free rows together, and
the free rows' time per step is what the constrained ones cost everybody else. Measured on a
tiny random-weight model (hidden 64) at two vocabularies: the synth tokenizer's (~512 ids) and a
Qwen2-sized one (a 151,936-row lm_head with the synthetic 150k byte-level BPE from
benchmarks/grammar_engines.py), where the mask fill and its application are at real-model size.

Constraints: "schema" = a JSON schema whose string field must be 300-400 chars (mask work inside
a JSON string, the common case; never finishes within the run), "json" = any JSON object (the
Earley parser at every step). Rows that end early are replaced, so the batch width stays c.

  python benchmarks/structured_overhead.py                # both vocabularies, c=1 and c=8
  python benchmarks/structured_overhead.py --vocab small --steps 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.load.blas import preload_optimized_blas  # noqa: E402

preload_optimized_blas()

import mlx.core as mx  # noqa: E402

from model.engine.engine import Engine  # noqa: E402
from model.engine.params import Constraint, SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.text import grammar as grammar_mod  # noqa: E402
from model.text.grammar import GrammarCompiler  # noqa: E402
from tests.fixtures.synth import write_model_dir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 300, "maxLength": 400}},
    "required": ["text"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "schema": Constraint("json_schema", json.dumps(SCHEMA), strict=True),
    "json": Constraint("json_object"),
}

_mask_s = [0.0]
_mask_n = [0]


def _timed_mask(orig: Any) -> Any:
    def mask(self: Any, width: int) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(self, width)
        finally:
            _mask_s[0] += time.perf_counter() - t0
            _mask_n[0] += 1

    return mask


def _timed_fill(orig: Any) -> Any:
    def fill(grammars: Any) -> None:
        t0 = time.perf_counter()
        try:
            orig(grammars)
        finally:
            _mask_s[0] += time.perf_counter() - t0

    return fill


grammar_mod.RowGrammar.mask = _timed_mask(grammar_mod.RowGrammar.mask)
grammar_mod.fill_masks = _timed_fill(grammar_mod.fill_masks)


def build_model(kind: str, root: Path) -> Path:
    if kind == "small":
        return write_model_dir(root / "small", hidden_size=64, num_hidden_layers=2)
    from benchmarks.grammar_engines import synth_tokenizer_json

    d = write_model_dir(root / "big", hidden_size=64, num_hidden_layers=2, vocab_size=151_936)
    tj = json.loads(synth_tokenizer_json(150_000))
    # Random weights do not care which tokenizer they are paired with: swap in the big one and
    # point the config's EOS at its <|endoftext|>.
    (d / "tokenizer.json").write_text(json.dumps(tj))
    eos = next(t["id"] for t in tj["added_tokens"] if t["content"] == "<|endoftext|>")
    for name in ("config.json", "generation_config.json"):
        path = d / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return d


def measure(engine: Engine, rows: list[SamplingParams], steps: int, prompt: tuple[int, ...]) -> dict[str, float]:
    """ms per decode step and per token with len(rows) rows kept live for `steps` steps."""
    next_id = [0]
    live: dict[int, SamplingParams] = {}

    def start(params: SamplingParams) -> None:
        rid = next_id[0]
        next_id[0] += 1
        engine.open_row(RowSpec(rid, prompt, params, 10_000))
        while engine.prefill(rid).remaining:
            pass
        first = engine.join(rid)
        if first.finish:
            engine.close_row(rid)
            start(params)
        else:
            live[rid] = params

    for p in rows:
        start(p)
    for _ in range(4):  # warm-up
        for t in engine.step():
            if t.finish:
                engine.close_row(t.row_id)
                start(live.pop(t.row_id))
    mx.synchronize()
    _mask_s[0], _mask_n[0] = 0.0, 0
    produced = 0
    elapsed = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        elapsed += time.perf_counter() - t0
        produced += len(outs)
        for t in outs:
            if t.finish:  # replace outside the timed region: keep the width at c
                engine.close_row(t.row_id)
                start(live.pop(t.row_id))
    for rid in list(live):
        engine.close_row(rid)
    return {
        "ms_per_step": elapsed / steps * 1e3,
        "ms_per_token": elapsed / max(1, produced) * 1e3,
        "mask_us_per_row_step": (_mask_s[0] / _mask_n[0] * 1e6) if _mask_n[0] else 0.0,
    }


def run(kind: str, root: Path, steps: int, repeats: int) -> dict[str, Any]:
    d = build_model(kind, root)
    loaded = load_model(d)
    eos = loaded.config.eos_token_ids
    t0 = time.perf_counter()
    compiler = GrammarCompiler.from_model_dir(d, vocab_size=loaded.config.raw["vocab_size"], eos_token_ids=eos)
    prep_ms = (time.perf_counter() - t0) * 1e3
    engine = Engine(loaded.model, eos_token_ids=eos, grammar_compiler=compiler)
    prompt = tuple(range(3, 40))
    free_greedy = SamplingParams()
    free_sampled = SamplingParams(temperature=1.0, seed=1)

    def con(name: str, seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, constraint=CONSTRAINTS[name])

    cases: dict[str, list[SamplingParams]] = {
        "c1 free greedy": [free_greedy],
        "c1 free sampled": [free_sampled],
        "c1 schema": [con("schema", 1)],
        "c1 json_object": [con("json", 1)],
        "c8 free greedy": [free_greedy] * 8,
        "c8 free sampled": [SamplingParams(temperature=1.0, seed=i) for i in range(8)],
        "c8 schema": [con("schema", i) for i in range(8)],
        "c8 json_object": [con("json", i) for i in range(8)],
        "c8 mixed 4 schema + 4 free sampled": [con("schema", i) for i in range(4)]
        + [SamplingParams(temperature=1.0, seed=10 + i) for i in range(4)],
    }
    out: dict[str, Any] = {"vocab": loaded.config.raw["vocab_size"], "compiler_prep_ms": prep_ms, "cases": {}}
    # The fastest of `repeats` runs per case, the cases interleaved round by round: other
    # processes on shared cores only ever add time, and they then hit every case alike.
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, rows in cases.items():
            m = measure(engine, rows, steps, prompt)
            if name not in best or m["ms_per_step"] < best[name]["ms_per_step"]:
                best[name] = m
    out["cases"] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", choices=("small", "big", "both"), default="both")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("small", "big") if args.vocab == "both" else (args.vocab,):
            r = run(kind, Path(tmp), args.steps, args.repeats)
            results[kind] = r
            print(
                f"\n== vocab {r['vocab']} (grammar tokenizer prep {r['compiler_prep_ms']:.0f} ms), "
                f"device {mx.default_device()}"
            )
            print(f"{'case':38s} {'ms/step':>8s} {'ms/token':>9s} {'grammar host us/row/step':>24s}")
            for case, m in r["cases"].items():
                print(f"{case:38s} {m['ms_per_step']:8.3f} {m['ms_per_token']:9.3f} {m['mask_us_per_row_step']:24.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

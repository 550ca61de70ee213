"""Turn-2 TTFT with the RAM prompt cache vs cold, for a >= 2k-token chat (Engine driven directly).

    python benchmarks/prompt_cache_ttft.py [--hidden 256] [--layers 4] [--system-words 1400]

TTFT = open_row + every prefill chunk + join (token 0 read back), the worker-side cost of the
first token. Turn 1 runs on an engine with a prompt cache (and a boundary snapshot, as the API
layer would ask); turn 2 is turn 1's history + the reply text + a new user message. Cold = the
same turn-2 prompt on a cache-less engine sharing the model. Best of --repeats, after a warm-up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:  # production's CPU BLAS, before anything imports mlx (see model/load/blas.py)
    from model.load.blas import preload_optimized_blas

    BLAS = preload_optimized_blas().log_line()
except Exception as e:  # noqa: BLE001 - a benchmark still runs on the bundled BLAS
    BLAS = f"BLAS: bundled ({e.__class__.__name__})"

from cache.boundary import stable_prefix_length  # noqa: E402
from cache.prompt_cache import PromptCache  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import RowSpec  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import EngineOptions  # noqa: E402
from model.text.tokenizer import Tokenizer  # noqa: E402
from tests.fixtures.synth import write_model_dir  # noqa: E402


def ttft(engine: Engine, row_id: int, prompt: list[int], snapshot_at: int | None = None) -> tuple[float, int, int]:
    """(seconds to token 0, cached_tokens, token 0); the row is then closed reusable."""
    start = time.perf_counter()
    opened = engine.open_row(RowSpec(row_id, tuple(prompt), SamplingParams(), 16, snapshot_at=snapshot_at))
    while engine.prefill(row_id).remaining:
        pass
    first = engine.join(row_id)
    elapsed = time.perf_counter() - start
    return elapsed, opened.cached_tokens, first.token


def finish(engine: Engine, row_id: int, first: int) -> list[int]:
    out = [first]
    done = False
    while not done:
        for t in engine.step():
            out.append(t.token)
            done = done or t.finish is not None
    engine.close_row(row_id, reusable=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(
            Path(tmp) / "m",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=4 * args.hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        model = load_model(model_dir).model
        tok = Tokenizer.from_dir(model_dir)
    words = ("the quick brown fox jumps over the lazy dog while agents share long system prompts " * 200).split()
    system = " ".join(words[: args.system_words])
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the rules above."}]
    p1 = tok.encode_chat(turn1)
    cold_engine = Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=args.prefill_chunk))
    ttft(cold_engine, 0, p1)  # warm-up
    cold_engine.close_row(0)

    colds, hots, cached = [], [], 0
    for r in range(args.repeats):
        hot = Engine(
            model,
            eos_token_ids=[],
            prompt_cache=PromptCache(1 << 30),
            options=EngineOptions(prefill_chunk=args.prefill_chunk),
        )
        t1, _, first = ttft(hot, 1, p1, snapshot_at=stable_prefix_length(tok, turn1, prompt_tokens=p1))
        reply = tok.decode(finish(hot, 1, first), skip_special_tokens=True)
        turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Now in one line."}]
        p2 = tok.encode_chat(turn2)
        t2, cached, first2 = ttft(hot, 2, p2)
        hot.close_row(2)
        c2, _, cold_first = ttft(cold_engine, 3, p2)
        cold_engine.close_row(3)
        assert cold_first == first2, "a cache hit changed token 0"
        colds.append(c2)
        hots.append(t2)

    cold, warm = min(colds), min(hots)
    print(BLAS)
    print(f"model: hidden {args.hidden}, {args.layers} layers, float32; prefill_chunk {args.prefill_chunk}")
    print(f"turn 1 prompt {len(p1)} tokens; turn 2 prompt {len(p2)} tokens, {cached} restored from the cache")
    print(f"cold TTFT (turn 2 prompt, no cache): {cold * 1e3:8.1f} ms")
    print(f"turn-2 TTFT (prompt cache hit):      {warm * 1e3:8.1f} ms")
    print(f"ratio cold / hit: {cold / warm:.1f}x")


if __name__ == "__main__":
    main()

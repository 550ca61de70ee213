"""TTFT of one 1024x1024 image + a ~100-token question, through our server's OpenAI chat API
(streaming), on a random-weight Qwen2.5-VL checkpoint at a real shape.

Synthesis draws every tensor with MLX on the default device (the GPU where there is one) and
writes bf16 shards with mx.save_safetensors: the text model through benchmarks/synth_fast.py, the
vision tower here (tests/fixtures/vlm.py's names and gains), so a 7B-VL checkpoint takes seconds.
A directory this script already wrote for the same shape is reused.

Then `python -m actors.serve --model DIR --port P` (default flags) and, after one warm-up request
with another image: N requests each with a fresh noise PNG (other content: a cache miss), the
last one repeated (a hit), a second turn on it (history + reply + new question: a hit on the
image), and the question alone (text-only, each a new variant). TTFT = request sent -> first
streamed token (the role chunk the server sends at once does not count). With --mlx-vlm, the
same image prompt through mlx-vlm's engine-level generate_step (PNG decode + its image processor
+ prefill to token 0), when mlx_vlm imports.

    python benchmarks/vlm_ttft.py --out /tmp/vlm.json                       # 7B shape (GPU)
    python benchmarks/vlm_ttft.py --shape tiny --out /tmp/vlm-tiny.json     # CPU smoke run
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from api.images import PLACEHOLDER  # noqa: E402
from benchmarks.serve_bench import Server, free_port  # noqa: E402
from benchmarks.synth_fast import fast_model_dir  # noqa: E402
from model.vision.preprocess import smart_resize  # noqa: E402
from tests.fixtures import vlm as vlm_fixture  # noqa: E402

# Qwen2.5-VL-7B-Instruct's preprocessor_config.json: a 1024x1024 image -> 1036x1036, 74x74 patches,
# 1369 tokens after the 2x2 merge.
REAL_PREPROCESSOR = {**vlm_fixture.PREPROCESSOR, "min_pixels": 3136, "max_pixels": 12845056}
SHAPES: dict[str, dict[str, Any]] = {
    "7b": {  # Qwen2.5-VL-7B-Instruct's config.json
        "text": dict(
            hidden_size=3584,
            num_hidden_layers=28,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            tie_word_embeddings=False,
            max_position_embeddings=128000,
            shards=5,
        ),
        "vision": {
            **vlm_fixture.VISION,
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 3584,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        "mrope_section": [16, 24, 24],
    },
    "tiny": {  # the test fixture's model, with the real image processor (the same 1369 image tokens)
        "text": dict(**vlm_fixture.TEXT, intermediate_size=128, shards=2),
        "vision": dict(vlm_fixture.VISION),
        "mrope_section": list(vlm_fixture.MROPE_SECTION),
    },
}
WORDS = (
    "what colour is the largest object in the picture and where does it sit relative to the others "
    "describe the texture of the background then count every distinct shape you can see"
).split()
NONCES = "amber basil cedar delta ember fjord grove harbor iris juniper kelp lotus".split()
MARKER = "vlm_ttft_shape.json"


# -- synthesis ---------------------------------------------------------------------------------


def resolve_shape(name: str, layers: int | None, vision_depth: int | None) -> dict[str, Any]:
    shape = json.loads(json.dumps(SHAPES[name]))  # a deep copy
    if layers is not None:
        shape["text"]["num_hidden_layers"] = layers
    if vision_depth is not None:
        vision = shape["vision"]
        vision["depth"] = vision_depth
        # Keep both block kinds: the real full-attention indexes below the depth, else the last.
        vision["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"] if i < vision_depth] or [
            vision_depth - 1
        ]
    shape["preprocessor"] = REAL_PREPROCESSOR
    return shape


def _write_vision(model_dir: Path, vision: dict[str, Any]) -> None:
    key = [mx.random.key(2)]

    def normal(shape: tuple[int, ...], std: float) -> mx.array:
        key[0], sub = mx.random.split(key[0])
        out = mx.random.normal(shape, dtype=mx.bfloat16, key=sub) * float(std)
        mx.eval(out)
        return out

    tensors = vlm_fixture.vision_tensors(normal, vision)
    tensors = {k: v.astype(mx.bfloat16) for k, v in tensors.items()}
    mx.save_safetensors(str(model_dir / "model-visual.safetensors"), tensors, metadata={"format": "pt"})
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():  # a sharded text model: the loader reads only the files its index names
        index = json.loads(index_path.read_text())
        index["weight_map"].update(dict.fromkeys(tensors, "model-visual.safetensors"))
        index["metadata"]["total_size"] += sum(v.nbytes for v in tensors.values())
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def synthesize(model_dir: Path, shape: dict[str, Any]) -> float:
    """Write the checkpoint (or reuse one written for the same shape); seconds spent."""
    marker = model_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()) == shape:
        print(f"vlm_ttft: reusing {model_dir}", flush=True)
        return 0.0
    t0 = time.perf_counter()
    text = dict(shape["text"])
    fast_model_dir(model_dir, family="qwen2", dtype="bfloat16", extra_added_tokens=vlm_fixture.VISION_TOKENS, **text)
    vision = {**shape["vision"], "out_hidden_size": text["hidden_size"]}
    vlm_fixture.add_vision_config(model_dir, vision, shape["mrope_section"], shape["preprocessor"])
    _write_vision(model_dir, vision)
    marker.write_text(json.dumps(shape, indent=2) + "\n")
    mx.clear_cache()  # the server gets the device's memory
    seconds = time.perf_counter() - t0
    print(f"vlm_ttft: wrote {model_dir} in {seconds:.1f}s", flush=True)
    return seconds


# -- requests ----------------------------------------------------------------------------------


def noise_png(size: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def pad_tokens(size: int, preprocessor: dict[str, Any]) -> int:
    """A size x size image's pad tokens under this preprocessor (its grid after the merge)."""
    factor = preprocessor["patch_size"] * preprocessor["merge_size"]
    h, w = smart_resize(size, size, factor, preprocessor["min_pixels"], preprocessor["max_pixels"])
    return (h // factor) * (w // factor)


def question_of(model_dir: Path, target_tokens: int) -> tuple[str, int]:
    """Words until the model's tokenizer counts `target_tokens` (the real Qwen tokenizer would
    count fewer: only the prompt's length matters here)."""
    from model.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    words: list[str] = []
    n = 0
    while n < target_tokens:
        words.append(WORDS[len(words) % len(WORDS)])
        n = len(tokenizer.encode(" ".join(words) + "?", add_special_tokens=False))
    return " ".join(words) + "?", n


def user(text: str, png: bytes | None = None) -> dict[str, Any]:
    if png is None:
        return {"role": "user", "content": text}
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
    }


def ttft(client: httpx.Client, server: Server, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": server.model_name,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payload = json.dumps(body).encode()  # encoded before the clock starts
    first, usage, text = None, None, []
    t0 = time.perf_counter()
    headers = {"content-type": "application/json"}
    with client.stream("POST", f"{server.url}/v1/chat/completions", content=payload, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content")
                if piece:
                    text.append(piece)
                if first is None and (piece or choice.get("finish_reason")):
                    first = time.perf_counter()
    end = time.perf_counter()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft_s": (first or end) - t0,
        "total_s": end - t0,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "text": "".join(text),
    }


def run_server(model_dir: Path, args: argparse.Namespace, question: str) -> dict[str, Any]:
    images = {seed: noise_png(args.image_size, seed) for seed in [1000, *range(1, args.repeats + 1)]}
    out: dict[str, Any] = {}
    with Server("ours", model_dir, free_port(), list(args.server_args)) as server, httpx.Client(timeout=600) as client:
        out["server_start_s"] = server.start_s

        def timed(label: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
            result = ttft(client, server, messages, args.max_tokens)
            print(f"  {label}: TTFT {result['ttft_s'] * 1000:.1f} ms, prompt {result['prompt_tokens']} tokens "
                  f"(cached {result['cached_tokens']})", flush=True)  # fmt: skip
            return result

        out["warm_up"] = timed("warm-up (image)", [user(question, images[1000])])
        out["image_miss"] = [
            timed(f"image {seed} (miss)", [user(question, images[seed])]) for seed in images if seed < 1000
        ]
        last = [user(question, images[args.repeats])]
        out["image_repeat"] = timed("same request again (hit)", last)
        history = [*last, {"role": "assistant", "content": out["image_miss"][-1]["text"]}]
        out["second_turn"] = timed("second turn (hit)", [*history, user("and " + question)])
        out["text_plain"] = timed("warm-up (text, the image prompt's text)", [user(question)])
        out["text_only"] = [timed(f"text {i} (miss)", [user(f"{NONCES[i]} {question}")]) for i in range(args.repeats)]
        out["server_log_tail"] = server.tail(1500)
    return out


# -- mlx-vlm -----------------------------------------------------------------------------------


def token_id(tokenizer: Any, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"the tokenizer has no {token}")
    return int(found)


def run_mlx_vlm(model_dir: Path, args: argparse.Namespace, question: str, image_tokens: int) -> dict[str, Any] | None:
    """Engine level: PNG decode + mlx-vlm's image processor + generate_step to token 0."""
    try:
        from mlx_vlm.generate.ar import generate_step
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs
        from mlx_vlm.utils import load_model as vlm_load_model
    except ImportError:
        return None
    from model.text.tokenizer import Tokenizer

    t0 = time.perf_counter()
    model = vlm_load_model(model_dir)
    load_s = time.perf_counter() - t0
    processor = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(str(model_dir), default_patch_size=14))
    tokenizer = Tokenizer.from_dir(model_dir)
    pad = token_id(tokenizer, "<|image_pad|>")
    # The prompts our API renders: the template over the placeholder text, the pad grown to the grid.
    ids = tokenizer.encode_chat([{"role": "user", "content": PLACEHOLDER + question}])
    at = ids.index(pad)
    prompt = mx.array([ids[:at] + [pad] * image_tokens + ids[at + 1 :]])
    text_prompt = mx.array([tokenizer.encode_chat([{"role": "user", "content": question}])])

    def first_token(png: bytes | None) -> float:
        start = time.perf_counter()
        pixels, kwargs = None, dict[str, Any]()
        tokens = prompt
        if png is None:
            tokens = text_prompt
        else:
            batch = processor([Image.open(io.BytesIO(png)).convert("RGB")])
            pixels = mx.array(np.asarray(batch["pixel_values"]))
            kwargs["image_grid_thw"] = mx.array(np.asarray(batch["image_grid_thw"]))
        lm = getattr(model, "language_model", None)
        if lm is not None and hasattr(lm, "_rope_deltas"):  # (its rope state outlives a generation)
            lm._rope_deltas = lm._position_ids = None
        steps = generate_step(tokens, model, pixels, None, max_tokens=1, temperature=0.0, **kwargs)
        token, _ = next(steps)
        mx.eval(token)
        elapsed = time.perf_counter() - start
        steps.close()
        return elapsed

    first_token(noise_png(args.image_size, 2000))  # warm-up
    image = [first_token(noise_png(args.image_size, 2000 + i)) for i in range(1, args.repeats + 1)]
    first_token(None)
    text = [first_token(None) for _ in range(args.repeats)]
    return {
        "load_s": load_s,
        "image_ttft_s": image,
        "text_ttft_s": text,
        "prompt_tokens": int(prompt.shape[1]),
        "text_prompt_tokens": int(text_prompt.shape[1]),
    }


# -- report ------------------------------------------------------------------------------------


def card() -> str:
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.split("\n")
        if names[0].strip():
            return names[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or platform.processor() or platform.machine())


def ms(seconds: float | None) -> str:
    return "" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.1f}"


def table(result: dict[str, Any]) -> str:
    s = result["server"]
    med = statistics.median
    rows = [
        ("image, cold (fresh image), median", med(r["ttft_s"] for r in s["image_miss"]), s["image_miss"][0]),
        ("image, same request again (cache hit)", s["image_repeat"]["ttft_s"], s["image_repeat"]),
        ("second turn on the image (cache hit)", s["second_turn"]["ttft_s"], s["second_turn"]),
        ("text only, same question, median", med(r["ttft_s"] for r in s["text_only"]), s["text_only"][0]),
    ]
    lines = [
        f"Qwen2.5-VL {result['shape_name']} shape (random bf16 weights), {result['card']}; "
        f"{result['image_size']}x{result['image_size']} PNG = {result['image_tokens']} image tokens, "
        f"question {result['question_tokens']} tokens",
        "",
        "| request | TTFT ms (ours) | prompt tokens | cached | TTFT ms (mlx-vlm engine) |",
        "|---|---|---|---|---|",
    ]
    theirs = result.get("mlx_vlm") or {}
    their = {0: theirs.get("image_ttft_s"), 3: theirs.get("text_ttft_s")}
    for i, (label, value, sample) in enumerate(rows):
        other = their.get(i)
        lines.append(
            f"| {label} | {ms(value)} | {sample['prompt_tokens']} | {sample['cached_tokens'] or 0} | "
            f"{ms(med(other)) if other else ''} |"
        )
    lines.append("")
    lines.append("cold image TTFTs ms: " + ", ".join(ms(r["ttft_s"]) for r in s["image_miss"]))
    lines.append(f"synthesis {result['synth_s']:.1f} s, server start (load + warm-up) {s['server_start_s']:.1f} s")
    if theirs:
        lines.append(
            "ours: over HTTP (base64 + PNG decode + resize + tower + prefill); mlx-vlm: in process, "
            f"generate_step to token 0 after PNG decode + its image processor (load {theirs['load_s']:.1f} s)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, default=None, help="override the text model's layer count")
    ap.add_argument("--vision-depth", type=int, default=None, help="override the vision tower's block count")
    ap.add_argument("--model-dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3, help="timed cold image (and text-only) requests")
    ap.add_argument("--question-tokens", type=int, default=100)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--mlx-vlm", action="store_true", help="also time mlx-vlm's generate_step (if importable)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("server_args", nargs="*", help="extra flags for actors.serve (after --)")
    args = ap.parse_args()

    shape = resolve_shape(args.shape, args.layers, args.vision_depth)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        model_dir = args.model_dir or Path(tmp) / f"qwen2_5_vl-{args.shape}"
        synth_s = synthesize(model_dir, shape)
        question, question_tokens = question_of(model_dir, args.question_tokens)
        server = run_server(model_dir, args, question)
        # The image's pad tokens (the prompt-token difference less its vision_start/end).
        image_tokens = server["image_miss"][0]["prompt_tokens"] - server["text_plain"]["prompt_tokens"] - 2
        expected = pad_tokens(args.image_size, shape["preprocessor"])
        if image_tokens != expected:
            print(f"vlm_ttft: {image_tokens} image tokens in usage, {expected} expected from the grid", flush=True)
        theirs = run_mlx_vlm(model_dir, args, question, expected) if args.mlx_vlm else None
        mx.clear_cache()
    result = {
        "card": card(),
        "shape_name": args.shape,
        "shape": shape,
        "image_size": args.image_size,
        "question_tokens": question_tokens,
        "image_tokens": image_tokens,
        "synth_s": synth_s,
        "server": server,
        "mlx_vlm": theirs,
    }
    report = table(result)
    result["table"] = report
    print(report, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

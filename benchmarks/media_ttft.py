"""TTFT of a video and of an audio clip, each with a ~100-token question, through our server's
OpenAI chat API (streaming), on random-weight checkpoints at real shapes (issue 51's GPU figure):

  video  Qwen3.5-0.8B with its vision tower (Qwen3-VL's) and Qwen's real image / video processor
         configs; a 10 s 1280x720 H.264 MP4 at 30 fps (`video_url` data: URL). At 2 fps that is
         20 frames, 10 temporal patches of 22x40 merged patches: 8800 video tokens.
  audio  Gemma 4 E2B with its vision and audio towers; a 30 s 16 kHz mono WAV (`input_audio`):
         750 audio tokens.

The GPU machine downloads nothing, so the checkpoints are written here: the configs are the real
ones (config.json values of Qwen/Qwen3.5-0.8B and google/gemma-4-E2B-it as written below), the
tensors drawn with MLX on the default device (the GPU where there is one) through
tests/fixtures/synth.py's and tests/fixtures/vlm.py's layouts (their names and gains; bf16 unless
--dtype), every tower the real checkpoint holds included (the loader is strict), so the server
loads them as it loads the real checkpoints. A directory written for the same shape is reused (a
marker file holds the shape). The clips are made here too (PyAV: libx264 when the wheel
has it, else MPEG-4 Part 2), content that differs per seed so each is a new cache key.

Per model: `python -m actors.serve --model DIR --port P` (default flags, plus any after `--`),
then a warm-up request with another clip of the same shape (the first request compiles kernels:
reported apart), N cold requests (each a clip the server has not seen: the tower and the whole
prefill run), the last one again (cached: the clip's content hash keys its tokens in the prompt
cache), a second turn on it (history + reply + new question), and the question alone (text
only). TTFT = request sent -> first streamed token (the role chunk does not count); the body is
encoded before the clock starts, so TTFT holds upload, base64 + container decode, frame resize,
the tower and the prefill. `cached` is usage.prompt_tokens_details.cached_tokens.

    python benchmarks/media_ttft.py --out /tmp/media.json                       # real shapes (GPU)
    python benchmarks/media_ttft.py --dtype float32 --text-layers 5 --vision-depth 1 --audio-layers 2 \\
        --video-seconds 2 --video-size 640x360 --out /tmp/m.json               # CPU smoke run (~3 min)

(On CPU bf16 is ~7x slower than float32.) benchmarks/gpu_media.sh runs it on a GPU.

A table goes to stderr, the JSON to --out.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import math
import statistics
import sys
import tempfile
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_bench import Server, free_port  # noqa: E402
from benchmarks.vlm_ttft import card, ttft  # noqa: E402
from tests.fixtures import synth, vlm  # noqa: E402

MARKER = "media_ttft_shape.json"
Normal = Callable[[tuple[int, ...], float], Any]  # (mx.array: synth's helpers are typed for numpy)

# -- real shapes ---------------------------------------------------------------------------------

# Qwen/Qwen3.5-0.8B's config.json (text_config, vision_config), preprocessor_config.json and
# video_preprocessor_config.json.
QWEN_TEXT: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=24,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    vocab_size=248320,
    tie_word_embeddings=True,
    max_position_embeddings=262144,
)
QWEN_TEXT_EXTRA: dict[str, Any] = {
    "full_attention_interval": 4,
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "attn_output_gate": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
}
QWEN_VISION: dict[str, Any] = {
    "model_type": "qwen3_5",
    "depth": 12,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_heads": 12,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [],
    "hidden_act": "gelu_pytorch_tanh",
    "out_hidden_size": 1024,
}
QWEN_IMAGE_PROCESSOR: dict[str, Any] = {
    **vlm.QWEN3_5_PREPROCESSOR,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
QWEN_VIDEO_PROCESSOR: dict[str, Any] = {
    **QWEN_IMAGE_PROCESSOR,
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},  # over all sampled frames
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
}

# google/gemma-4-E2B-it's config.json (text_config, vision_config, audio_config).
GEMMA_TEXT: dict[str, Any] = dict(
    hidden_size=1536,
    num_hidden_layers=35,
    intermediate_size=6144,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
GEMMA_TEXT_EXTRA: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 512,
    "sliding_window_pattern": 5,  # (synth draws by it; the loader reads layer_types)
    "global_head_dim": 512,
    "attention_k_eq_v": False,
    "num_global_key_value_heads": None,
    "num_kv_shared_layers": 20,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "enable_moe_block": False,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}
GEMMA_VISION: dict[str, Any] = {
    **vlm.GEMMA4_VISION,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "global_head_dim": 64,
    "position_embedding_size": 10240,
    "use_clipped_linears": True,
}
GEMMA_AUDIO: dict[str, Any] = {
    **vlm.GEMMA4_AUDIO,
    "model_type": "gemma4_audio",
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "subsampling_conv_channels": [128, 32],
    "output_proj_dims": 1536,
    "hidden_act": "silu",
}
GEMMA_PROCESSOR: dict[str, Any] = {
    "processor_class": "Gemma4Processor",
    "image_processor": {"patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3},
    "image_seq_length": 280,
    "audio_seq_length": 750,
    "audio_ms_per_token": 40,
}

WORDS = (
    "what does the speaker say first and what happens in the scene after that describe the sounds the "
    "colours and the motion then list every object you notice in the order it appears"
).split()


# -- synthesis -----------------------------------------------------------------------------------


def resolve_shape(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """The shape to write: the real one, with the reductions asked for (CPU smoke runs)."""
    if kind == "video":
        text, extra = dict(QWEN_TEXT), json.loads(json.dumps(QWEN_TEXT_EXTRA))
        if args.text_layers:
            text["num_hidden_layers"] = args.text_layers
        vision = {**QWEN_VISION, "depth": args.vision_depth or QWEN_VISION["depth"]}
        return {"kind": kind, "dtype": args.dtype, "text": text, "extra": extra, "vision": vision}
    text, extra = dict(GEMMA_TEXT), json.loads(json.dumps(GEMMA_TEXT_EXTRA))
    layers = args.text_layers or text["num_hidden_layers"]
    text["num_hidden_layers"] = layers
    pattern = extra["sliding_window_pattern"]
    extra["layer_types"] = [
        "full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(layers)
    ]
    if layers != GEMMA_TEXT["num_hidden_layers"]:  # as many shared as E2B's share, an unshared full layer kept
        extra["num_kv_shared_layers"] = max(0, min(round(layers * 20 / 35), layers - pattern))
    vision = {**GEMMA_VISION, "num_hidden_layers": args.vision_depth or GEMMA_VISION["num_hidden_layers"]}
    audio = {**GEMMA_AUDIO, "num_hidden_layers": args.audio_layers or GEMMA_AUDIO["num_hidden_layers"]}
    return {"kind": kind, "dtype": args.dtype, "text": text, "extra": extra, "vision": vision, "audio": audio}


def _drawer(dtype: mx.Dtype, seed: int) -> Normal:
    """normal(shape, std) drawn with MLX, evaluated at once (the next draw reuses the memory)."""
    key = [mx.random.key(seed)]
    chunk = 1 << 28  # large tables in row blocks (Gemma's per-layer embedding has 2.3e9 entries)

    def draw(shape: tuple[int, ...], std: float) -> mx.array:
        key[0], sub = mx.random.split(key[0])
        out = mx.random.normal(shape, dtype=dtype, key=sub) * float(std)
        mx.eval(out)
        return out

    def normal(shape: tuple[int, ...], std: float) -> mx.array:
        size = math.prod(shape)
        if size <= chunk or len(shape) < 2:
            return draw(shape, std)
        rows = max(1, chunk // math.prod(shape[1:]))
        blocks = [draw((min(rows, shape[0] - r), *shape[1:]), std) for r in range(0, shape[0], rows)]
        out = mx.concatenate(blocks)
        mx.eval(out)
        return out

    return normal


def _dtype(plan: Any) -> mx.Dtype:
    return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[plan.dtype]


def _text_drawers(plan: Any) -> tuple[Normal, Callable[[int], mx.array]]:
    dtype = _dtype(plan)
    normal = _drawer(dtype, 0)

    def norm_weight(size: int) -> mx.array:
        return (1.0 + normal((size,), 0.05)).astype(dtype)

    return normal, norm_weight


def _nested(tensors: dict[str, Any]) -> dict[str, Any]:
    """The text model's `model.*` under `model.language_model.*`, as the multimodal checkpoints ship it."""
    return {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()
    }


def _with_extra(plan: Any, extra: dict[str, Any]) -> Any:
    """The plan of synth's family with the real shape's keys (synth's own are tiny test shapes)."""
    return attrs.evolve(plan, family=attrs.evolve(plan.family, extra_config={**plan.family.extra_config, **extra}))


def _qwen_maker(shape: dict[str, Any]) -> Callable[[Any, Any], dict[str, Any]]:
    def make(plan: Any, rng: Any) -> dict[str, Any]:
        del rng  # numpy's; MLX draws here
        plan = _with_extra(plan, shape["extra"])
        normal, norm_weight = _text_drawers(plan)
        embed = synth._embedding_rows(plan, normal((plan.vocab_size, plan.hidden_size), 1.0))
        tensors = synth._hybrid_tensors(plan, {"model.embed_tokens.weight": embed}, normal, norm_weight)
        if plan.tie_word_embeddings:  # (the real checkpoint has no lm_head)
            del tensors["lm_head.weight"]
            tensors["model.embed_tokens.weight"] = synth._output_rows(plan, tensors["model.embed_tokens.weight"])
        return {**_nested(tensors), **vlm.qwen3_5_vision_tensors(_drawer(_dtype(plan), 1), shape["vision"])}

    return make


def _gemma_maker(shape: dict[str, Any]) -> Callable[[Any, Any], dict[str, Any]]:
    def make(plan: Any, rng: Any) -> dict[str, Any]:
        plan = _with_extra(plan, shape["extra"])
        normal, norm_weight = _text_drawers(plan)
        embed = synth._embedding_rows(plan, normal((plan.vocab_size, plan.hidden_size), 1.0))
        tensors = synth._gemma4_tensors(plan, {"model.embed_tokens.weight": embed}, normal, norm_weight, rng)
        towers_normal = _drawer(_dtype(plan), 1)
        towers = vlm.gemma4_vision_tensors(towers_normal, shape["vision"], plan.hidden_size)
        if shape["vision"]["use_clipped_linears"]:  # (the real tower stores each linear's clip bounds)
            for name in [k for k in towers if k.endswith(".linear.weight")]:
                for bound, value in (
                    ("input_min", -1e4),
                    ("input_max", 1e4),
                    ("output_min", -1e4),
                    ("output_max", 1e4),
                ):
                    towers[name.replace(".linear.weight", f".{bound}")] = np.array(value, dtype=np.float32)
        towers |= vlm.gemma4_audio_tensors(towers_normal, shape["audio"], plan.hidden_size)
        return {**_nested(tensors), **towers}

    return make


def _write_json(path: Path, body: dict[str, Any]) -> None:
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def _multimodal_config(model_dir: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The text config.json synth wrote, as a text_config, and the tokenizer's special ids."""
    vocab = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {e["content"]: e["id"] for e in vocab["added_tokens"]}
    text = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text.pop("architectures", None)
    return text, ids


def write_qwen(model_dir: Path, shape: dict[str, Any]) -> None:
    """Qwen3_5ForConditionalGeneration as Hugging Face ships it (vlm.write_qwen3_5_vl_dir's layout)."""
    t = shape["text"]
    synth._write(
        model_dir,
        _qwen_maker(shape),
        family="qwen3_5",
        dtype=shape["dtype"],
        extra_added_tokens=vlm.VISION_TOKENS,
        extra_config=shape["extra"],
        shards=2,
        rope_theta=shape["extra"]["rope_parameters"]["rope_theta"],
        **t,
    )
    text, ids = _multimodal_config(model_dir)
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {**shape["vision"], "out_hidden_size": t["hidden_size"]},
        "tie_word_embeddings": t["tie_word_embeddings"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
    }
    _write_json(model_dir / "config.json", config)
    _write_json(model_dir / "preprocessor_config.json", QWEN_IMAGE_PROCESSOR)
    _write_json(model_dir / "video_preprocessor_config.json", QWEN_VIDEO_PROCESSOR)


def write_gemma(model_dir: Path, shape: dict[str, Any]) -> None:
    """Gemma4ForConditionalGeneration as Hugging Face ships it (vlm.write_gemma4_dir's layout)."""
    t = shape["text"]
    synth._write(
        model_dir,
        _gemma_maker(shape),
        family="gemma4_text",
        dtype=shape["dtype"],
        extra_added_tokens=vlm.GEMMA4_TOKENS,
        extra_config=shape["extra"],
        shards=6 if t["num_hidden_layers"] > 8 else 2,
        **t,
    )
    text, ids = _multimodal_config(model_dir)
    config = {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": {**text, "model_type": "gemma4_text"},
        "vision_config": shape["vision"],
        "audio_config": shape["audio"],
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": True,
        "image_token_id": ids["<|image|>"],
        "boi_token_id": ids["<|image>"],
        "eoi_token_id": ids["<image|>"],
        "audio_token_id": ids["<|audio|>"],
        "boa_token_id": ids["<|audio>"],
        "eoa_token_id": ids["<audio|>"],
    }
    _write_json(model_dir / "config.json", config)
    _write_json(model_dir / "processor_config.json", GEMMA_PROCESSOR)


def synthesize(model_dir: Path, shape: dict[str, Any]) -> float:
    """Write the checkpoint (or reuse one written for the same shape); seconds spent."""
    marker = model_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()) == shape:
        log(f"media_ttft: reusing {model_dir}")
        return 0.0
    t0 = time.perf_counter()
    (write_qwen if shape["kind"] == "video" else write_gemma)(model_dir, shape)
    _write_json(marker, shape)
    mx.clear_cache()  # the server gets the device's memory
    seconds = time.perf_counter() - t0
    gb = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e9
    log(f"media_ttft: wrote {model_dir} ({gb:.1f} GB) in {seconds:.1f}s")
    return seconds


# -- media ---------------------------------------------------------------------------------------


def video_codec() -> str:
    import av

    try:
        av.codec.Codec("libx264", "w")
        return "libx264"
    except Exception:  # a PyAV build without x264
        return "mpeg4"


def make_clip(seed: int, width: int, height: int, fps: int, seconds: float) -> bytes:
    """An MP4 of a panning textured scene with a moving block: compressible as camera footage is
    (~1.4 Mbit/s at 720p with libx264), its content different per seed."""
    import av

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0 : 2 * width].astype(np.float32)
    phases = rng.uniform(0, 2 * np.pi, 3)
    base = np.stack([127 + 100 * np.sin(xx / 37.0 + phases[c] + yy / 53.0 * (c + 1)) for c in range(3)], -1)
    base = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    buf = io.BytesIO()
    codec = video_codec()
    with av.open(buf, mode="w", format="mp4") as out:
        stream: Any = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "veryfast", "crf": "23"}
        else:
            stream.bit_rate = 2_000_000
        block = max(16, height // 9)
        for i in range(int(round(fps * seconds))):
            offset = (i * 3) % width
            frame = np.ascontiguousarray(base[:, offset : offset + width])
            y, x = (i * 5) % (height - block), (i * 7) % (width - 2 * block)
            frame[y : y + block, x : x + 2 * block] = colour
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def make_wav(seed: int, seconds: float, rate: int = 16_000) -> bytes:
    """A mono 16-bit WAV that sounds like voiced speech: a gliding pitch with harmonics, syllable
    envelopes and breath noise, different per seed."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * rate))
    t = np.arange(n, dtype=np.float64) / rate
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6)) + 10 * rng.standard_normal()
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = np.clip(np.sin(2 * np.pi * rng.uniform(3, 5) * t + rng.uniform(0, 6)), 0, None) ** 2
    signal = 0.3 * voice * envelope + 0.02 * rng.standard_normal(n)
    pcm = (np.clip(signal, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


def video_facts(model_dir: Path, clip: bytes) -> dict[str, Any]:
    """What the server makes of the clip: frames sampled, grid, pad tokens (from its header)."""
    from model.vision.video import VideoProcessorConfig, grid_for, read_video_header, sample_indices

    config = VideoProcessorConfig.read(model_dir)
    header = read_video_header(clip)
    frames = len(sample_indices(header.frames, header.fps, config))
    t, gh, gw = grid_for(frames, header.height, header.width, config)
    tokens = t * gh * gw // config.merge_size**2
    return {
        "source": f"{header.width}x{header.height}, {header.frames} frames at {header.fps:g} fps",
        "sampled_frames": frames,
        "grid_thw": [t, gh, gw],
        "resized": f"{gw * config.patch_size}x{gh * config.patch_size}",
        "pad_tokens": tokens,
    }


def audio_facts(model_dir: Path, clip: bytes) -> dict[str, Any]:
    from model.audio.decode import SAMPLE_RATE, read_audio_header
    from model.audio.features import AudioFeatureConfig

    header = read_audio_header(clip, "wav")
    tokens = AudioFeatureConfig.read(model_dir).tokens(int(round(header.seconds * SAMPLE_RATE)))
    return {"source": f"{header.seconds:g} s, {header.rate} Hz, {header.channels} ch", "pad_tokens": tokens}


def data_part(kind: str, clip: bytes) -> dict[str, Any]:
    encoded = base64.b64encode(clip).decode()
    if kind == "video":
        return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + encoded}}
    return {"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}}


def user(text: str, part: dict[str, Any] | None = None) -> dict[str, Any]:
    if part is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [part, {"type": "text", "text": text}]}


# -- the run -------------------------------------------------------------------------------------


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def make_media(kind: str, args: argparse.Namespace) -> tuple[dict[int, bytes], float]:
    """The warm-up clip (seed 1000) and the cold ones (1..repeats); seconds spent."""
    t0 = time.perf_counter()
    seeds = [1000, *range(1, args.repeats + 1)]
    if kind == "video":
        width, height = (int(x) for x in args.video_size.split("x"))
        clips = {s: make_clip(s, width, height, args.video_fps, args.video_seconds) for s in seeds}
    else:
        clips = {s: make_wav(s, args.audio_seconds) for s in seeds}
    seconds = time.perf_counter() - t0
    size = statistics.mean(len(c) for c in clips.values()) / 1e6
    log(f"media_ttft: {len(clips)} {kind} clips of {size:.2f} MB in {seconds:.1f}s")
    return clips, seconds


def question_of(model_dir: Path, target_tokens: int) -> tuple[str, int]:
    """Words until the checkpoint's (synthetic) tokenizer counts `target_tokens`."""
    from model.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    words: list[str] = []
    n = 0
    while n < target_tokens:
        words.append(WORDS[len(words) % len(WORDS)])
        n = len(tokenizer.encode(" ".join(words) + "?", add_special_tokens=False))
    return " ".join(words) + "?", n


def layers_of(shape: dict[str, Any]) -> str:
    text = f"{shape['text']['num_hidden_layers']} text layers"
    if shape["kind"] == "video":
        return f"{text}, vision depth {shape['vision']['depth']}"
    return f"{text}, audio {shape['audio']['num_hidden_layers']} blocks"


@contextlib.contextmanager
def running(model_dir: Path, extra: list[str], pid_file: Path | None) -> Iterator[Server]:
    """Our server on `model_dir`, stopped (SIGINT) on the way out and killed if its start is
    interrupted; its pid appended to `pid_file` (gpu_media.sh's trap kills what is left)."""
    server = Server("ours", model_dir, free_port(), extra)
    try:
        server.__enter__()
    except BaseException:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        raise
    if pid_file is not None and server.proc is not None:
        with pid_file.open("a") as f:
            f.write(f"{server.proc.pid}\n")
    try:
        yield server
    except BaseException:
        log(server.tail(4000))
        raise
    finally:
        server.__exit__(None, None, None)


def run_server(
    model_dir: Path, kind: str, clips: dict[int, bytes], question: str, args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    parts = {seed: data_part(kind, clip) for seed, clip in clips.items()}
    with running(model_dir, list(args.server_args), args.pid_file) as server, httpx.Client(timeout=600) as client:
        out["server_start_s"] = server.start_s

        def timed(label: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
            result = ttft(client, server, messages, args.max_tokens)
            result["label"] = label
            log(f"  {label}: TTFT {result['ttft_s'] * 1000:.1f} ms, prompt {result['prompt_tokens']} tokens "
                f"(cached {result['cached_tokens']})")  # fmt: skip
            return result

        out["first"] = timed(f"first {kind} request (compiles kernels)", [user(question, parts[1000])])
        out["cold"] = [timed(f"{kind} {seed} (cold)", [user(question, parts[seed])]) for seed in parts if seed < 1000]
        last = [user(question, parts[args.repeats])]
        out["cached"] = timed("same request again (cached)", last)
        history = [*last, {"role": "assistant", "content": out["cold"][-1]["text"] or "ok"}]
        out["second_turn"] = timed("second turn on it (cached)", [*history, user("and " + question)])
        timed("warm-up (question alone)", [user("so " + question)])
        out["text_only"] = timed("question alone (text only)", [user(question)])
        out["server_log_tail"] = server.tail(2000)
    return out


def ms(seconds: float | None) -> str:
    return "" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.0f}"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"Card: {result['card']} ({result['device']}); random {result['dtype']} weights at the real shapes "
        "(but for the reductions named)"
    ]
    for kind, run in result["runs"].items():
        s, facts = run["server"], run["media"]
        if kind == "video":
            what = (
                f"Qwen3.5-0.8B ({run['layers']}), {facts['source']} -> {facts['sampled_frames']} frames "
                f"at {facts['resized']}, grid {facts['grid_thw']}, {facts['pad_tokens']} video tokens"
            )
        else:
            what = f"Gemma 4 E2B ({run['layers']}), {facts['source']} -> {facts['pad_tokens']} audio tokens"
        what += f"; question {run['question_tokens']} tokens"
        cold = statistics.median(r["ttft_s"] for r in s["cold"])
        rows = [
            ("first request (kernels compile)", s["first"]["ttft_s"], s["first"]),
            (f"cold (a new clip), median of {len(s['cold'])}", cold, s["cold"][0]),
            ("cached (the same request again)", s["cached"]["ttft_s"], s["cached"]),
            ("second turn on the clip", s["second_turn"]["ttft_s"], s["second_turn"]),
            ("question alone (text only)", s["text_only"]["ttft_s"], s["text_only"]),
        ]
        lines += ["", what, "", "| request | TTFT ms | prompt tokens | cached tokens |", "|---|---|---|---|"]
        lines += [f"| {label} | {ms(v)} | {r['prompt_tokens']} | {r['cached_tokens'] or 0} |" for label, v, r in rows]
        lines.append(
            f"cold TTFTs ms: {', '.join(ms(r['ttft_s']) for r in s['cold'])}; clip {run['clip_mb']:.2f} MB; "
            f"synthesis {run['synth_s']:.1f} s, clips {run['media_s']:.1f} s, server start {s['server_start_s']:.1f} s"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("video", "audio"), action="append", help="one model (default: both)")
    ap.add_argument("--model-root", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--text-layers", type=int, default=None, help="reduce the text model's layers (CPU)")
    ap.add_argument("--vision-depth", type=int, default=None, help="reduce the vision towers' blocks (CPU)")
    ap.add_argument("--audio-layers", type=int, default=None, help="reduce the audio tower's blocks (CPU)")
    ap.add_argument("--video-seconds", type=float, default=10.0)
    ap.add_argument("--video-size", default="1280x720", help="WIDTHxHEIGHT")
    ap.add_argument("--video-fps", type=int, default=30)
    ap.add_argument("--audio-seconds", type=float, default=30.0)
    ap.add_argument("--repeats", type=int, default=2, help="cold requests (each a new clip)")
    ap.add_argument("--question-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("--pid-file", type=Path, default=None, help="append each server's pid here")
    ap.add_argument("server_args", nargs="*", help="extra flags for actors.serve (after --)")
    args = ap.parse_args()

    result: dict[str, Any] = {"card": card(), "device": str(mx.default_device()), "dtype": args.dtype, "runs": {}}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = args.model_root or Path(tmp)
        for kind in args.only or ["video", "audio"]:
            shape = resolve_shape(kind, args)
            model_dir = root / ("qwen3_5-0.8b" if kind == "video" else "gemma4-e2b")
            synth_s = synthesize(model_dir, shape)
            question, question_tokens = question_of(model_dir, args.question_tokens)
            clips, media_s = make_media(kind, args)
            facts = (video_facts if kind == "video" else audio_facts)(model_dir, clips[1])
            log(f"media_ttft: {kind}: {facts}")
            run = {
                "shape": shape,
                "layers": layers_of(shape),
                "media": facts,
                "question_tokens": question_tokens,
                "clip_mb": len(clips[1]) / 1e6,
                "synth_s": synth_s,
                "media_s": media_s,
                "server": run_server(model_dir, kind, clips, question, args),
            }
            result["runs"][kind] = run
            if args.out:  # each model's result as soon as it is in
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    report = table(result)
    result["table"] = report
    log(report)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Qwen3.5 video (model/vision/video.py, model/families/qwen3_5_vl.py): frames sampled from a
container, patches and timestamps equal mlx-vlm's Qwen3-VL video processor; a video row's greedy
tokens equal mlx-vlm's qwen3_5 generate; batched beside a text row it is unchanged, and a second
turn on the same video hits the prompt cache and equals a cold run."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the parity oracle) is not installed")
pytest.importorskip("av", reason="PyAV decodes video")
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (  # noqa: E402
    Qwen3VLVideoProcessor,
    _qwen_vl_video_kwargs,
    _video_group_timestamps,
)
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402

from cache.prompt_cache import PromptCache  # noqa: E402
from model.engine.rows import ImageInput  # noqa: E402
from model.families.qwen3_5_vl import Qwen35VLModel  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.text.tokenizer import Tokenizer  # noqa: E402
from model.vision.header import ImageError  # noqa: E402
from model.vision.video import (  # noqa: E402
    VideoProcessorConfig,
    decode_frames,
    prepare_video,
    read_video_header,
    resized_size,
    sample_indices,
    timestamps,
)
from tests.engine_helpers import decode_to_the_end, generate_tokens  # noqa: E402
from tests.fixtures.vlm import write_qwen3_5_vl_dir  # noqa: E402
from tests.helpers.media import encode_video, noise_frames  # noqa: E402
from tests.helpers.vlm import N_TOKENS, row_spec, vlm_engine  # noqa: E402


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_5_vl_dir(tmp_path_factory.mktemp("qwen3_5_video") / "qwen3_5")


@pytest.fixture(scope="module")
def ours(vl_dir: Path) -> Qwen35VLModel:
    model = load_model(vl_dir).model
    assert isinstance(model, Qwen35VLModel)
    return model


def video(vl_dir: Path, data: bytes, digest: str = "v1"):
    """(ImageInput, its timestamps, the sampled frames at source size, the header)."""
    config = VideoProcessorConfig.read(vl_dir)
    header = read_video_header(data)
    indices = sample_indices(header.frames, header.fps, config)
    size = resized_size(len(indices), header.height, header.width, config)
    prepared = prepare_video(decode_frames(data, indices, size), config)
    t, h, w = prepared.grid_thw
    item = ImageInput(prepared.pixel_values, prepared.grid_thw, digest, kind="video", runs=(h * w // 4,) * t)
    return item, timestamps(indices, header.fps, config.temporal_patch_size), indices, header


def video_prompt(vl_dir: Path, model: Qwen35VLModel, item: ImageInput, stamps: list[float]) -> list[int]:
    """Text, then each temporal patch's "<t seconds>" and its pad run (Qwen3-VL's processor), then text."""
    tokenizer = Tokenizer.from_dir(vl_dir)
    prompt = [5, 17, 42]
    for seconds, run in zip(stamps, item.runs):
        prompt += tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
        prompt += [model.vision_start_token_id] + [model.video_token_id] * run + [model.vision_end_token_id]
    return prompt + [99, 3, 250]


def test_sampling_takes_fps_frames_a_second_within_the_bounds():
    config = VideoProcessorConfig(fps=2.0, min_frames=4, max_frames=12)
    assert sample_indices(50, 10.0, config) == [0, 5, 11, 16, 22, 27, 33, 38, 44, 49]  # 5 s at 2 fps
    assert sample_indices(10, 10.0, config) == [0, 3, 6, 9]  # 1 s: min_frames
    assert len(sample_indices(1000, 10.0, config)) == 12  # 100 s: max_frames
    assert sample_indices(3, 30.0, config) == [0, 1, 2]  # no more than there are
    assert timestamps([0, 11, 22], 10.0, 2) == [0.55, 2.2]  # the last frame repeats to fill its patch


def test_patches_and_timestamps_equal_mlx_vlms_video_processor(vl_dir):
    data = encode_video(noise_frames(25), fps=10)
    item, stamps, indices, header = video(vl_dir, data)
    frames = decode_frames(data, indices, (header.height, header.width))  # source size: theirs resizes
    metadata = {"frames_indices": indices, "fps": header.fps}
    ref = Qwen3VLVideoProcessor(**_qwen_vl_video_kwargs(str(vl_dir)))(frames, video_metadata=[metadata])
    assert item.grid_thw == tuple(np.array(ref["video_grid_thw"])[0].tolist())
    assert np.array_equal(item.pixels, np.array(ref["pixel_values_videos"]))
    assert stamps == _video_group_timestamps(item.grid_thw[0], 2, 2.0, metadata)


def test_a_container_that_is_not_a_video_is_an_image_error():
    with pytest.raises(ImageError, match="cannot decode video"):
        read_video_header(b"\x00\x00\x00\x18ftypmp42 not really a video")


def test_video_row_equals_mlx_vlm(vl_dir, ours):
    theirs = vlm_load_model(vl_dir)
    item, stamps, _, _ = video(vl_dir, encode_video(noise_frames(25), fps=10))
    prompt = video_prompt(vl_dir, ours, item, stamps)
    steps = generate_step(
        mx.array([prompt]), theirs, mx.array(item.pixels), None, max_tokens=N_TOKENS, temperature=0.0,
        prefill_step_size=None, video_grid_thw=mx.array([item.grid_thw]),
    )  # fmt: skip
    want = [int(t.item() if hasattr(t, "item") else t) for t, _ in steps]
    assert len(set(want)) > 4
    for chunk in (2048, 16):  # chunks of 16 cut through the frames' runs
        assert generate_tokens(vlm_engine(ours, chunk=chunk), [row_spec(0, prompt, [item])])[0] == want
    other, _, _, _ = video(vl_dir, encode_video(noise_frames(25, seed=7), fps=10), "v2")
    assert generate_tokens(vlm_engine(ours), [row_spec(0, prompt, [other])])[0] != want  # the video matters


def test_a_video_row_batches_and_its_second_turn_hits_the_cache(vl_dir, ours, monkeypatch):
    item, stamps, _, _ = video(vl_dir, encode_video(noise_frames(25), fps=10))
    turn1 = video_prompt(vl_dir, ours, item, stamps)
    specs = [row_spec(0, turn1, [item]), row_spec(1, [5, 17, 42, 99, 3, 250, 11, 7])]
    solo = {s.row_id: generate_tokens(vlm_engine(ours), [s])[s.row_id] for s in specs}
    assert generate_tokens(vlm_engine(ours), specs) == solo

    encoded = []
    encode = Qwen35VLModel.encode_images
    monkeypatch.setattr(Qwen35VLModel, "encode_images", lambda self, *a: encoded.append(1) or encode(self, *a))
    hot = vlm_engine(ours, cache=PromptCache(1 << 30))
    first = generate_tokens(hot, [row_spec(0, turn1, [item])], reusable=True)[0]
    turn2 = turn1 + first + [11, 300, 2, 77]
    assert hot.open_row(row_spec(1, turn2, [item])).cached_tokens >= len(turn1)
    while hot.prefill(1).remaining:
        pass
    hot_tokens = decode_to_the_end(hot, {1: [hot.join(1).token]}, {1})[1]
    assert len(encoded) == 1  # turn 2 never ran the tower
    assert hot_tokens == generate_tokens(vlm_engine(ours), [row_spec(1, turn2, [item])])[1]

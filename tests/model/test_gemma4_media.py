"""Gemma 4 with its towers (model/families/gemma4.py): image patches, vision and audio features
and greedy tokens of prompts with an image or an audio clip equal mlx-vlm's gemma4 (its image
processor and feature extractor, its towers and generate_step) on tiny random checkpoints, images
attending bidirectionally too; through the engine, media rows batch beside a text row unchanged
and a second turn that hits the prompt cache equals a cold run."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the parity oracle) is not installed")
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.models.gemma4.audio_feature_extractor import Gemma4AudioFeatureExtractor  # noqa: E402
from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor  # noqa: E402
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402

from cache.prompt_cache import PromptCache  # noqa: E402
from model.audio.features import AudioFeatureConfig, log_mel, mel_filter_bank  # noqa: E402
from model.engine.rows import ImageInput  # noqa: E402
from model.families.gemma4 import Gemma4Model  # noqa: E402
from model.families.gemma4_text import Gemma4TextModel  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.vision.gemma4 import Gemma4ImageConfig  # noqa: E402
from tests.engine_helpers import decode_to_the_end, generate_tokens  # noqa: E402
from tests.fixtures.vlm import write_gemma4_dir  # noqa: E402
from tests.helpers.vlm import IMAGES, N_TOKENS, noise_image, row_spec, vlm_engine  # noqa: E402

TEXT = [99, 3, 250, 11, 7]


@pytest.fixture(scope="module")
def g4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma4_dir(tmp_path_factory.mktemp("gemma4") / "gemma4")


@pytest.fixture(scope="module")
def ours(g4_dir: Path) -> Gemma4Model:
    model = load_model(g4_dir).model
    assert isinstance(model, Gemma4Model) and model.media_kinds == {"image", "audio"}
    return model


@pytest.fixture(scope="module")
def theirs(g4_dir: Path):
    return vlm_load_model(g4_dir)


def processor() -> Gemma4ImageProcessor:
    return Gemma4ImageProcessor(patch_size=16, max_soft_tokens=16, pooling_kernel_size=3)


def image_item(model_dir: Path, image, digest: str = "i1") -> tuple[ImageInput, np.ndarray]:
    """(the engine's image, mlx-vlm's [1, C, H, W] pixels for it)."""
    prepared = Gemma4ImageConfig.read(model_dir).prepare(image)
    (runs,) = Gemma4ImageConfig.read(model_dir).runs(prepared.grid_thw)
    pixels = processor()([image])[0]["pixel_values"]
    return ImageInput(prepared.pixel_values, prepared.grid_thw, digest, "image", (runs,)), pixels


def audio_item(samples: np.ndarray, digest: str = "a1") -> tuple[ImageInput, dict]:
    """(the engine's clip, mlx-vlm's input_features kwargs for it)."""
    config = AudioFeatureConfig()
    features = log_mel(samples, config)
    grid = (1, features.shape[0], config.valid_frames(len(samples)))
    ref = Gemma4AudioFeatureExtractor()(samples)
    kwargs = {
        "input_features": mx.array(ref["input_features"][0])[None],
        "input_features_mask": mx.array(ref["input_features_mask"][0])[None],
    }
    return ImageInput(features, grid, digest, "audio", (config.tokens(len(samples)),)), kwargs


def prompt(model: Gemma4Model, item: ImageInput) -> list[int]:
    i = model.ids
    open_, pad, close = {
        "image": (i["boi_token_id"], i["image_token_id"], i["eoi_token_id"]),
        "audio": (i["boa_token_id"], i["audio_token_id"], i["eoa_token_id"]),
    }[item.kind]
    return [5, 17, 42, open_, *[pad] * item.runs[0], close, *TEXT]


def their_greedy(model, tokens: list[int], pixels=None, **kwargs) -> list[int]:
    steps = generate_step(
        mx.array([tokens]), model, None if pixels is None else mx.array(pixels), None, max_tokens=N_TOKENS,
        temperature=0.0, prefill_step_size=None, **kwargs,
    )  # fmt: skip
    return [int(t.item() if hasattr(t, "item") else t) for t, _ in steps]


def noise(samples: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(samples) * 0.1).astype(np.float32)


def test_image_patches_equal_mlx_vlms_processor(g4_dir):
    config = Gemma4ImageConfig.read(g4_dir)
    for image in [*IMAGES, noise_image(400, 300, 3), noise_image(20, 30, 4, "L"), noise_image(30, 900, 5)]:
        pixels, (tokens,) = processor()([image])
        prepared = config.prepare(image)
        c, h, w = pixels["pixel_values"].shape[1:]
        ref = pixels["pixel_values"][0].reshape(c, h // 16, 16, w // 16, 16).transpose(1, 3, 2, 4, 0).reshape(-1, 768)
        assert np.array_equal(prepared.pixel_values, ref) and config.runs(prepared.grid_thw) == (tokens,)


def test_image_and_audio_features_equal_mlx_vlms(ours, theirs, g4_dir):
    for image in IMAGES:
        item, pixels = image_item(g4_dir, image)
        want = theirs.embed_vision(theirs.vision_tower(mx.array(pixels)))[0]
        assert mx.array_equal(ours.encode_media([item]), want).item()
    fe = Gemma4AudioFeatureExtractor()
    assert np.array_equal(mel_filter_bank(257, 128, 0.0, 8000.0, 16_000), fe.mel_filters)
    for samples in (16_000, 16_641, 9_000, 23_999):  # the clip's tokens: its valid encoder frames
        item, kwargs = audio_item(noise(samples))
        assert np.array_equal(item.pixels, np.array(kwargs["input_features"][0]))
        assert item.grid_thw[2] == int(kwargs["input_features_mask"].sum())
        encoded, mask = theirs.audio_tower(kwargs["input_features"], ~kwargs["input_features_mask"])
        assert item.runs == (int((~mask).sum()),)
        assert mx.array_equal(ours.encode_media([item]), theirs.embed_audio(encoded)[0][: item.runs[0]]).item()


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_a_media_row_equals_mlx_vlm(ours, theirs, g4_dir, kind):
    if kind == "image":
        item, pixels = image_item(g4_dir, IMAGES[0])
        want = their_greedy(theirs, prompt(ours, item), pixels)
        other, _ = image_item(g4_dir, noise_image(168, 224, 9), "i2")
    else:
        item, kwargs = audio_item(noise(16_641))
        want = their_greedy(theirs, prompt(ours, item), **kwargs)
        other, _ = audio_item(noise(16_641, seed=5), "a2")
    assert len(set(want)) > 4  # not a degenerate repeat: the check can fail
    for chunk in (2048, 8):  # chunks of 8 cut through the item's run
        assert generate_tokens(vlm_engine(ours, chunk=chunk), [row_spec(0, prompt(ours, item), [item])])[0] == want
    assert generate_tokens(vlm_engine(ours), [row_spec(0, prompt(ours, other), [other])])[0] != want


def test_bidirectional_images_equal_mlx_vlm(tmp_path):
    model_dir = write_gemma4_dir(tmp_path / "gemma4_bidi", audio=False, bidirectional=True)
    ours, theirs = load_model(model_dir).model, vlm_load_model(model_dir)
    assert isinstance(ours, Gemma4Model) and ours.atomic_media == {"image"}
    item, pixels = image_item(model_dir, IMAGES[0])
    tokens = prompt(ours, item)
    types = (mx.array([tokens]) == ours.image_token_id).astype(mx.int32)
    want = their_greedy(theirs, tokens, pixels, mm_token_type_ids=types)
    assert want != their_greedy(theirs, tokens, pixels)  # the image's tokens seeing each other matters
    for chunk in (2048, 8):  # a chunk never cuts the image: it ends before it, or takes it whole
        assert generate_tokens(vlm_engine(ours, chunk=chunk), [row_spec(0, tokens, [item])])[0] == want


def test_media_rows_batch_and_a_second_turn_hits_the_cache(ours, g4_dir, monkeypatch):
    image, _ = image_item(g4_dir, IMAGES[0])
    clip, _ = audio_item(noise(16_641))
    specs = [
        row_spec(0, prompt(ours, image), [image]),
        row_spec(1, [5, 17, 42, *TEXT]),
        row_spec(2, prompt(ours, clip), [clip]),
    ]
    solo = {s.row_id: generate_tokens(vlm_engine(ours), [s])[s.row_id] for s in specs}
    assert generate_tokens(vlm_engine(ours), specs) == solo

    encoded = []
    encode = Gemma4Model.encode_media
    monkeypatch.setattr(Gemma4Model, "encode_media", lambda self, items: encoded.append(1) or encode(self, items))
    for item in (image, clip):
        hot = vlm_engine(ours, cache=PromptCache(1 << 30))
        turn1 = prompt(ours, item)
        first = generate_tokens(hot, [row_spec(0, turn1, [item])], reusable=True)[0]
        turn2 = turn1 + first + [11, 300, 2, 77]
        encoded.clear()
        assert hot.open_row(row_spec(1, turn2, [item])).cached_tokens >= len(turn1)
        while hot.prefill(1).remaining:
            pass
        hot_tokens = decode_to_the_end(hot, {1: [hot.join(1).token]}, {1})[1]
        assert not encoded  # turn 2 never ran a tower
        assert hot_tokens == generate_tokens(vlm_engine(ours), [row_spec(1, turn2, [item])])[1]


def test_a_checkpoint_without_tower_weights_serves_text(tmp_path, g4_dir):
    import shutil

    text_dir = tmp_path / "text_only"
    shutil.copytree(g4_dir, text_dir)
    (text_dir / "model-towers.safetensors").unlink()
    model = load_model(text_dir).model
    assert isinstance(model, Gemma4TextModel) and not getattr(model, "media_kinds", ())

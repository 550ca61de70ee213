"""Qwen2.5-VL: preprocessing, vision features and greedy tokens of prompts with images equal
mlx-vlm's (its image processor, vision tower and generate_step) on a tiny random checkpoint;
text-only rows run through the engine like any family."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

# The oracle is installed without its heavy extras (.ci/run: pip install --no-deps mlx-vlm).
pytest.importorskip("mlx_vlm", reason="mlx-vlm (the parity oracle) is not installed")
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs  # noqa: E402
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402

from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.families.qwen2_5_vl import Qwen25VLModel
from model.load.loader import load_model
from model.options import EngineOptions
from model.vision.preprocess import ImageError, ImageProcessorConfig, decode_image, smart_resize
from tests.engine_helpers import generate_tokens
from tests.fixtures.vlm import write_vlm_dir
from tests.helpers.vlm import IMAGES, N_TOKENS, noise_image, prepared, prompt_with, their_greedy


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vlm_dir(tmp_path_factory.mktemp("vlm") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def ours(vlm_dir: Path) -> Qwen25VLModel:
    model = load_model(vlm_dir).model
    assert isinstance(model, Qwen25VLModel)
    return model


@pytest.fixture(scope="module")
def theirs(vlm_dir: Path):
    return vlm_load_model(vlm_dir)


def our_greedy(model: Qwen25VLModel, prompt: list[int], images, chunks: tuple[int, ...] = ()) -> list[int]:
    """A prefill over the spliced embeddings at mrope positions (split at `chunks`, as the engine's
    chunked prefill would), then decode at cache offset + the row's delta."""
    grids = [p.grid_thw for p in images]
    tokens = mx.array([prompt])
    features = model.encode_images(mx.array(np.concatenate([p.pixel_values for p in images])), grids)
    positions, delta = model.image_positions(prompt, grids)
    embeddings = model.embed_with_images(tokens, features)
    caches = model.make_caches()
    for a, b in zip((0, *chunks), (*chunks, len(prompt))):
        hidden = model(tokens[:, a:b], caches, embeddings=embeddings[:, a:b], positions=positions[:, :, a:b])
    out: list[int] = []
    y = mx.argmax(model.logits(hidden[:, -1]), axis=-1)
    while len(out) < N_TOKENS:
        out.append(int(y.item()))
        y = mx.argmax(model.logits(model(y[None], caches, delta=delta)[:, -1]), axis=-1)
    return out


# -- preprocessing -------------------------------------------------------------------------------


def test_patches_equal_mlx_vlms_image_processor(vlm_dir):
    images = [*IMAGES, noise_image(400, 300, 3), noise_image(20, 30, 4, "L"), noise_image(90, 90, 5, "RGBA")]
    ref = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(str(vlm_dir), default_patch_size=14))(images)
    got = prepared(vlm_dir, images)
    assert [p.grid_thw for p in got] == [tuple(g) for g in np.array(ref["image_grid_thw"]).tolist()]
    assert np.array_equal(np.concatenate([p.pixel_values for p in got]), np.array(ref["pixel_values"]))


def test_resize_keeps_within_the_pixel_bounds():
    config = ImageProcessorConfig()
    assert smart_resize(168, 224, 28, 56 * 56, 28 * 28 * 64) == (168, 224)
    h, w = smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 64)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 64 and h > w
    h, w = smart_resize(10, 10, 28, 56 * 56, config.max_pixels)
    assert (h, w) == (56, 56)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 4000, 28, 56 * 56, config.max_pixels)


def test_undecodable_bytes_are_an_image_error():
    with pytest.raises(ImageError, match="cannot decode"):
        decode_image(b"not an image")
    import io

    buf = io.BytesIO()
    IMAGES[1].save(buf, format="PNG")
    assert decode_image(buf.getvalue()).size == (100, 60)


# -- the model -----------------------------------------------------------------------------------


def test_vision_features_equal_mlx_vlms_tower(vlm_dir, ours, theirs):
    images = prepared(vlm_dir, IMAGES)
    pixels = mx.array(np.concatenate([p.pixel_values for p in images]))
    grids = [p.grid_thw for p in images]
    got = ours.encode_images(pixels, grids)
    assert got.shape == (sum(p.token_count(2) for p in images), 64)
    assert mx.array_equal(got, theirs.vision_tower(pixels, mx.array(grids))).item()


def test_mrope_positions_equal_mlx_vlms_rope_index(vlm_dir, ours, theirs):
    images = prepared(vlm_dir, IMAGES)
    prompt = prompt_with(ours, [p.token_count(2) for p in images])
    grids = [p.grid_thw for p in images]
    want, want_delta = theirs.language_model.get_rope_index(mx.array([prompt]), mx.array(grids))
    got, delta = ours.image_positions(prompt, grids)
    assert np.array_equal(np.array(got), np.array(want)) and delta == int(want_delta.item())
    assert delta < 0  # an image's tokens span fewer positions than tokens


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_with_images_equals_mlx_vlm(vlm_dir, ours, theirs, n_images):
    images = prepared(vlm_dir, IMAGES[:n_images])
    prompt = prompt_with(ours, [p.token_count(2) for p in images])
    got = our_greedy(ours, prompt, images)
    assert got == their_greedy(theirs, prompt, images)
    assert len(set(got)) > 4  # not a degenerate repeat: the check can fail
    # The image matters: another picture of the same size answers differently.
    other = prepared(vlm_dir, [noise_image(168, 224, 9), *IMAGES[1:n_images]])
    assert our_greedy(ours, prompt, other) != got


def test_chunked_prefill_through_an_image_equals_one_forward(vlm_dir, ours):
    images = prepared(vlm_dir, IMAGES)
    prompt = prompt_with(ours, [p.token_count(2) for p in images])
    whole = our_greedy(ours, prompt, images)
    assert our_greedy(ours, prompt, images, chunks=(2, 20, len(prompt) - 5)) == whole  # cuts inside image 1


def test_image_features_must_match_the_pad_tokens(ours):
    tokens = mx.array([[5, ours.image_token_id, ours.image_token_id, 7]])
    with pytest.raises(ValueError, match="2 image-pad tokens but 3 image features"):
        ours.embed_with_images(tokens, mx.zeros((3, 64)))


def test_text_only_rows_in_the_engine_equal_mlx_vlm_and_batch(vlm_dir, ours, theirs):
    prompts = [[5, 17, 42, 99, 3, 250, 11, 7], [300, 2, 77]]
    want = []
    for p in prompts:
        theirs.language_model._rope_deltas = theirs.language_model._position_ids = None
        steps = generate_step(mx.array([p]), theirs, None, None, max_tokens=N_TOKENS, temperature=0.0)
        want.append([int(t.item() if hasattr(t, "item") else t) for t, _ in steps])
    engine = Engine(ours, eos_token_ids=[], options=EngineOptions())
    specs = [RowSpec(i, tuple(p), SamplingParams(), N_TOKENS) for i, p in enumerate(prompts)]
    solo = [generate_tokens(engine, [s])[s.row_id] for s in specs]
    assert solo == want
    assert generate_tokens(engine, specs) == dict(enumerate(solo))

"""Qwen3.5 with its vision tower (model/families/qwen3_5_vl.py): preprocessing, vision features,
multimodal RoPE positions and greedy tokens of prompts with images equal mlx-vlm's qwen3_5 (its
image processor, vision tower and generate_step) on a tiny random checkpoint; through the engine,
an image row equals mlx-vlm's, a text row batched beside it is unchanged, and a second turn that
hits the prompt cache equals a cold run."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the parity oracle) is not installed")
from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor, _qwen_vl_image_kwargs  # noqa: E402
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402

from cache.prompt_cache import PromptCache  # noqa: E402
from model.families.qwen3_5 import Qwen35Model  # noqa: E402
from model.families.qwen3_5_vl import Qwen35VLModel  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from tests.engine_helpers import decode_to_the_end, generate_tokens  # noqa: E402
from tests.fixtures.vlm import write_qwen3_5_vl_dir  # noqa: E402
from tests.helpers.vlm import (  # noqa: E402
    IMAGES,
    media_inputs,
    noise_image,
    prepared,
    prompt_with,
    row_spec,
    their_greedy,
    vlm_engine,
)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_5_vl_dir(tmp_path_factory.mktemp("qwen3_5_vl") / "qwen3_5")


@pytest.fixture(scope="module")
def ours(vl_dir: Path) -> Qwen35VLModel:
    model = load_model(vl_dir).model
    assert isinstance(model, Qwen35VLModel)
    return model


@pytest.fixture(scope="module")
def theirs(vl_dir: Path):
    return vlm_load_model(vl_dir)


def counts(vl_dir: Path, images) -> list[int]:
    return [p.token_count(2) for p in prepared(vl_dir, images)]


def test_patches_equal_mlx_vlms_image_processor(vl_dir):
    images = [*IMAGES, noise_image(400, 300, 3), noise_image(20, 30, 4, "L")]
    ref = Qwen3VLImageProcessor(**_qwen_vl_image_kwargs(str(vl_dir), default_patch_size=16))(images)
    got = prepared(vl_dir, images)
    assert [p.grid_thw for p in got] == [tuple(g) for g in np.array(ref["image_grid_thw"]).tolist()]
    assert np.array_equal(np.concatenate([p.pixel_values for p in got]), np.array(ref["pixel_values"]))


def test_features_and_positions_equal_mlx_vlms(vl_dir, ours, theirs):
    images = prepared(vl_dir, IMAGES)
    pixels, grids = mx.array(np.concatenate([p.pixel_values for p in images])), [p.grid_thw for p in images]
    got = ours.encode_images(pixels, grids)
    want, _ = theirs.vision_tower(pixels, mx.array(grids))
    assert got.shape == (sum(counts(vl_dir, IMAGES)), 64) and mx.array_equal(got, want).item()
    prompt = prompt_with(ours, counts(vl_dir, IMAGES))
    want_positions, want_delta = theirs.language_model.get_rope_index(mx.array([prompt]), mx.array(grids))
    positions, delta = ours.image_positions(prompt, grids)
    assert np.array_equal(np.array(positions), np.array(want_positions)) and delta == int(want_delta.item()) < 0


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_row_equals_mlx_vlm(vl_dir, ours, theirs, n_images):
    images = IMAGES[:n_images]
    prompt = prompt_with(ours, counts(vl_dir, images))
    want = their_greedy(theirs, prompt, prepared(vl_dir, images))
    assert len(set(want)) > 4  # not a degenerate repeat: the check can fail
    # Chunks of 16 cut through the images; the join and every decode step run at the row's delta.
    for chunk in (2048, 16):
        got = generate_tokens(vlm_engine(ours, chunk=chunk), [row_spec(0, prompt, media_inputs(vl_dir, images))])
        assert got[0] == want
    other = media_inputs(vl_dir, [noise_image(168, 224, 9), *IMAGES[1:n_images]])
    assert generate_tokens(vlm_engine(ours), [row_spec(0, prompt, other)])[0] != want  # the image matters


def test_rows_batched_beside_an_image_row_are_unchanged(vl_dir, ours):
    one = prompt_with(ours, counts(vl_dir, IMAGES[:1]))
    two = prompt_with(ours, counts(vl_dir, IMAGES))
    specs = [
        row_spec(0, one, media_inputs(vl_dir, IMAGES[:1])),
        row_spec(1, [5, 17, 42, 99, 3, 250, 11, 7]),  # text only: delta 0 in the batch's delta array
        row_spec(2, two, media_inputs(vl_dir, IMAGES)),
    ]
    solo = {s.row_id: generate_tokens(vlm_engine(ours), [s])[s.row_id] for s in specs}
    assert generate_tokens(vlm_engine(ours), specs) == solo


def test_a_second_turn_hits_the_cache_and_equals_a_cold_run(vl_dir, ours, monkeypatch):
    encoded = []
    encode = Qwen35VLModel.encode_images
    monkeypatch.setattr(Qwen35VLModel, "encode_images", lambda self, *a: encoded.append(1) or encode(self, *a))
    hot = vlm_engine(ours, cache=PromptCache(1 << 30))
    image = media_inputs(vl_dir, IMAGES[:1])
    turn1 = prompt_with(ours, counts(vl_dir, IMAGES[:1]))
    first = generate_tokens(hot, [row_spec(0, turn1, image)], reusable=True)[0]
    turn2 = turn1 + first + [11, 300, 2, 77]
    opened = hot.open_row(row_spec(1, turn2, image))
    assert opened.cached_tokens >= len(turn1)  # a state cache: exactly what turn 1 covered
    while hot.prefill(1).remaining:
        pass
    hot_tokens = decode_to_the_end(hot, {1: [hot.join(1).token]}, {1})[1]
    assert len(encoded) == 1  # the hit covered the image: the tower ran for turn 1 only
    assert hot_tokens == generate_tokens(vlm_engine(ours), [row_spec(1, turn2, image)])[1]


def test_a_checkpoint_without_vision_weights_serves_text(tmp_path, vl_dir):
    import shutil

    text_dir = tmp_path / "text_only"
    shutil.copytree(vl_dir, text_dir)
    (text_dir / "model-visual.safetensors").unlink()
    model = load_model(text_dir).model
    assert isinstance(model, Qwen35Model) and not model.media_kinds and "visual" not in model

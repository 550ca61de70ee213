"""Rows with images through the engine (model/engine/image_rows.py): greedy tokens equal mlx-vlm's, a
text or image row batched beside another is unchanged, chunked prefill crosses an image, and the
prompt cache keys an image's run by its content hash (the same image hits and equals a cold run,
a different one of the same size misses)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm (the parity oracle) is not installed")
from mlx_vlm.utils import load_model as vlm_load_model  # noqa: E402

from cache.prompt_cache import PromptCache  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.params import SamplingParams  # noqa: E402
from model.engine.rows import ImageInput, RowSpec  # noqa: E402
from model.families.qwen2_5_vl import Qwen25VLModel  # noqa: E402
from model.load.loader import load_model  # noqa: E402
from model.options import EngineOptions  # noqa: E402
from tests.engine_helpers import decode_to_the_end, generate_tokens  # noqa: E402
from tests.fixtures.vlm import write_vlm_dir  # noqa: E402
from tests.helpers.vlm import IMAGES, N_TOKENS, noise_image, prepared, prompt_with, their_greedy  # noqa: E402


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vlm_dir(tmp_path_factory.mktemp("vlm_engine") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def ours(vlm_dir: Path) -> Qwen25VLModel:
    model = load_model(vlm_dir).model
    assert isinstance(model, Qwen25VLModel)
    return model


def inputs(vlm_dir: Path, images) -> tuple[ImageInput, ...]:
    out = []
    for image, p in zip(images, prepared(vlm_dir, images)):
        digest = hashlib.sha256(image.tobytes()).hexdigest()
        out.append(ImageInput(p.pixel_values, p.grid_thw, digest))
    return tuple(out)


def spec(row_id: int, prompt: list[int], images=(), max_tokens: int = N_TOKENS) -> RowSpec:
    return RowSpec(row_id, tuple(prompt), SamplingParams(), max_tokens, images=tuple(images))


def engine(model, *, cache: PromptCache | None = None, chunk: int = 2048) -> Engine:
    return Engine(model, eos_token_ids=[], prompt_cache=cache, options=EngineOptions(prefill_chunk=chunk))


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_row_equals_mlx_vlm(vlm_dir, ours, n_images):
    theirs = vlm_load_model(vlm_dir)
    images = IMAGES[:n_images]
    prompt = prompt_with(ours, [p.token_count(2) for p in prepared(vlm_dir, images)])
    want = their_greedy(theirs, prompt, prepared(vlm_dir, images))
    # Chunks of 16 cut through the images; the join and every decode step run at the row's delta.
    for chunk in (2048, 16):
        assert generate_tokens(engine(ours, chunk=chunk), [spec(0, prompt, inputs(vlm_dir, images))])[0] == want
    assert len(set(want)) > 4


def test_rows_batched_beside_image_rows_are_unchanged(vlm_dir, ours):
    one = prompt_with(ours, [prepared(vlm_dir, IMAGES[:1])[0].token_count(2)])
    two = prompt_with(ours, [p.token_count(2) for p in prepared(vlm_dir, IMAGES)])
    specs = [
        spec(0, one, inputs(vlm_dir, IMAGES[:1])),
        spec(1, [5, 17, 42, 99, 3, 250, 11, 7]),  # text only: delta 0 in the batch's delta array
        spec(2, two, inputs(vlm_dir, IMAGES)),
    ]
    solo = {s.row_id: generate_tokens(engine(ours), [s])[s.row_id] for s in specs}
    assert generate_tokens(engine(ours), specs) == solo
    # Joined together (join_group): image rows take the ordinary join, the text row defers.
    e = engine(ours)
    for s in specs:
        e.open_row(s)
        while e.prefill(s.row_id).remaining:
            pass
    outs = e.join_group([s.row_id for s in specs])
    assert [o is None for o in outs] == [False, True, False]
    got = {s.row_id: [o.token] if o is not None else [] for s, o in zip(specs, outs)}
    assert decode_to_the_end(e, got, {s.row_id for s in specs}) == solo


def test_image_rows_are_not_grouped(vlm_dir, ours):
    e = engine(ours)
    prompt = prompt_with(ours, [prepared(vlm_dir, IMAGES[:1])[0].token_count(2)])
    e.open_row(spec(0, prompt, inputs(vlm_dir, IMAGES[:1])))
    e.open_row(spec(1, [5, 17, 42, 99]))
    assert not e.groupable(0) and e.groupable(1)


def test_same_image_hits_the_cache_and_a_different_one_misses(vlm_dir, ours, monkeypatch):
    encoded = []
    encode = Qwen25VLModel.encode_images
    monkeypatch.setattr(Qwen25VLModel, "encode_images", lambda self, *a: encoded.append(1) or encode(self, *a))
    cache = PromptCache(1 << 30)
    hot = engine(ours, cache=cache)
    image = inputs(vlm_dir, IMAGES[:1])
    turn1 = prompt_with(ours, [image[0].grid_thw[1] * image[0].grid_thw[2] // 4])
    first = generate_tokens(hot, [spec(0, turn1, image)], reusable=True)[0]
    turn2 = turn1 + first + [11, 300, 2, 77]
    assert len(encoded) == 1
    opened = hot.open_row(spec(1, turn2, image))
    assert opened.cached_tokens >= len(turn1)  # the prompt and what was generated after it
    out = {1: []}
    while hot.prefill(1).remaining:
        pass
    out[1].append(hot.join(1).token)
    hot_tokens = decode_to_the_end(hot, out, {1}, reusable=True)[1]
    assert len(encoded) == 1  # the hit covered the image: only the text after it was embedded
    assert hot_tokens == generate_tokens(engine(ours), [spec(1, turn2, image)])[1]

    # Another picture of the same size: same token ids, different key. Only the text before it hits.
    other = inputs(vlm_dir, [noise_image(168, 224, 9)])
    first_pad = turn2.index(ours.image_token_id)
    opened = hot.open_row(spec(2, turn2, other))
    assert opened.cached_tokens <= first_pad
    out = {2: []}
    while hot.prefill(2).remaining:
        pass
    out[2].append(hot.join(2).token)
    cold_other = generate_tokens(engine(ours), [spec(2, turn2, other)])[2]
    assert decode_to_the_end(hot, out, {2})[2] == cold_other != hot_tokens

    # A text-only prompt with the same token ids (pads as text) never matches an image entry.
    assert hot.open_row(spec(3, turn2)).cached_tokens <= first_pad


def test_images_need_a_vision_model_and_matching_pad_runs(vlm_dir, ours, qwen3_dir):
    text_model = load_model(qwen3_dir).model
    image = inputs(vlm_dir, IMAGES[:1])
    with pytest.raises(ValueError, match="no vision tower"):
        engine(text_model).open_row(spec(0, [5, 6, 7], image))
    short = prompt_with(ours, [3])
    with pytest.raises(ValueError, match="image-pad run of 3 tokens"):
        engine(ours).open_row(spec(0, short, image))
    with pytest.raises(ValueError, match="0 image-pad runs"):
        engine(ours).open_row(spec(0, [5, 6, 7], image))


def test_a_forked_image_row_equals_its_source(vlm_dir, ours):
    prompt = prompt_with(ours, [prepared(vlm_dir, IMAGES[:1])[0].token_count(2)])
    image = inputs(vlm_dir, IMAGES[:1])
    want = generate_tokens(engine(ours), [spec(0, prompt, image)])[0]
    e = engine(ours)
    e.open_row(spec(0, prompt, image))
    while e.prefill(0).remaining:
        pass
    e.fork_rows(0, [spec(1, prompt, image)])
    out = {0: [e.join(0).token], 1: [e.join(1).token]}
    assert decode_to_the_end(e, out, {0, 1}) == {0: want, 1: want}

"""Embeddings from the model layer equal mlx-lm's final-norm hidden states, pooled and normalized
as the sentence-transformers files say; batching, chunking and truncation change nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from model.engine.embedding import embed
from model.load.embedding_config import JOB_MAX_INPUTS, Pooling, plan_jobs, read_pooling
from model.load.errors import ModelLoadError
from model.load.loader import load_model
from tests.fixtures.embedding import write_embedding_model_dir

INPUTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [3] * 23, [200], list(range(30, 70))]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding")
    return {
        "lasttoken": write_embedding_model_dir(root / "last", pooling="lasttoken"),
        "mean": write_embedding_model_dir(root / "mean", pooling="mean"),
        "cls": write_embedding_model_dir(root / "cls", pooling="cls", normalize=False),
        "official": write_embedding_model_dir(root / "official", pooling="lasttoken", layout="official"),
    }


def reference(model_dir: Path, tokens: list[int], mode: str, normalize: bool = True) -> np.ndarray:
    """mlx-lm's model on one input: final-norm hidden states, pooled, normalized."""
    model, _ = mlx_lm_load_model(model_dir)
    hidden = np.array(model.model(mx.array([tokens]))[0].astype(mx.float32))
    pooled = {"lasttoken": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[mode]
    return pooled / np.linalg.norm(pooled) if normalize else pooled


def cosine(a: np.ndarray | list[float], b: np.ndarray | list[float]) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_batch_matches_mlx_lm_hidden_states(dirs, mode):
    loaded = load_model(dirs[mode])
    assert loaded.pooling == Pooling(mode=mode, normalize=True, dimensions=64)
    vectors = embed(loaded.model, INPUTS, loaded.pooling)
    assert len(vectors) == len(INPUTS)
    for tokens, vector in zip(INPUTS, vectors):
        expected = reference(dirs[mode], tokens, mode)
        assert len(vector) == 64
        assert cosine(vector, expected) >= 0.9999
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(vector, expected, atol=1e-4)


def test_cls_pooling_without_normalize_is_the_first_state(dirs):
    loaded = load_model(dirs["cls"])
    assert loaded.pooling == Pooling(mode="cls", normalize=False, dimensions=64)
    for tokens, vector in zip(INPUTS, embed(loaded.model, INPUTS, loaded.pooling)):
        np.testing.assert_allclose(vector, reference(dirs["cls"], tokens, "cls", normalize=False), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_batched_and_chunked_equal_each_input_alone(dirs, mode):
    loaded = load_model(dirs[mode])
    batched = embed(loaded.model, INPUTS, loaded.pooling)
    chunked = embed(loaded.model, INPUTS, loaded.pooling, chunk=4)  # several pieces, as prefill does
    for index, tokens in enumerate(INPUTS):
        alone = embed(loaded.model, [tokens], loaded.pooling)[0]
        np.testing.assert_allclose(batched[index], alone, atol=1e-5)
        np.testing.assert_allclose(chunked[index], alone, atol=1e-5)
        assert cosine(batched[index], alone) >= 0.99999


def test_dimensions_truncate_then_renormalize(dirs):
    loaded = load_model(dirs["lasttoken"])
    full = embed(loaded.model, INPUTS, loaded.pooling)
    short = embed(loaded.model, INPUTS, loaded.pooling, dimensions=16)
    for whole, part in zip(full, short):
        prefix = np.asarray(whole[:16])
        assert len(part) == 16
        np.testing.assert_allclose(part, prefix / np.linalg.norm(prefix), atol=1e-5)


def test_official_layout_flat_keys_and_no_head_loads_the_same_model(dirs):
    weights = mx.load(str(dirs["official"] / "model.safetensors"))
    assert "embed_tokens.weight" in weights and not any(k.startswith(("model.", "lm_head")) for k in weights)
    assert json.loads((dirs["official"] / "config.json").read_text())["tie_word_embeddings"] is False
    official, mlx_layout = load_model(dirs["official"]), load_model(dirs["lasttoken"])
    np.testing.assert_allclose(
        embed(official.model, INPUTS, official.pooling), embed(mlx_layout.model, INPUTS, mlx_layout.pooling), atol=1e-6
    )


def test_empty_input_is_refused(dirs):
    loaded = load_model(dirs["lasttoken"])
    with pytest.raises(ValueError):
        embed(loaded.model, [[1, 2], []], loaded.pooling)


# -- detection ------------------------------------------------------------------------------


def test_generative_dir_has_no_pooling(qwen3_dir):
    assert read_pooling(qwen3_dir, 64) is None
    assert load_model(qwen3_dir).pooling is None


def _st_dir(tmp_path: Path, modules: list[dict], pooling: dict | None) -> Path:
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


POOL = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORM = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_pooling_read_from_sentence_transformers_files(tmp_path):
    model_dir = _st_dir(tmp_path, [POOL, NORM], {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    assert read_pooling(model_dir, 64) == Pooling("mean", True, 64)
    assert read_pooling(model_dir, 64).truncatable


def test_no_pooling_module_is_a_generative_model(tmp_path):
    model_dir = _st_dir(tmp_path, [{"path": "", "type": "sentence_transformers.models.Transformer"}], None)
    assert read_pooling(model_dir, 64) is None


@pytest.mark.parametrize(
    ("modules", "config", "message"),
    [
        ([POOL], {"pooling_mode_max_tokens": True}, "unsupported pooling"),
        ([POOL], {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True}, "exactly one"),
        ([POOL], {}, "unsupported pooling"),
        (
            [POOL, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
            {"pooling_mode_cls_token": True},
            "Dense",
        ),
        ([POOL], {"pooling_mode_cls_token": True, "word_embedding_dimension": 32}, "word_embedding_dimension"),
        ([POOL], None, "missing config.json"),
    ],
)
def test_pooling_we_cannot_run_fails_the_load(tmp_path, modules, config, message):
    with pytest.raises(ModelLoadError, match=message):
        read_pooling(_st_dir(tmp_path, modules, config), 64)


# -- job planning ---------------------------------------------------------------------------


def test_plan_jobs_groups_similar_lengths_within_the_bounds():
    lengths = [5, 3000, 7, 9000, 6, 20000, *([10] * 40)]
    jobs = plan_jobs(lengths, max_tokens=16384)
    assert sorted(i for job in jobs for i in job) == list(range(len(lengths)))
    for job in jobs:
        assert len(job) <= JOB_MAX_INPUTS
        assert len(job) == 1 or len(job) * max(lengths[i] for i in job) <= 16384
    assert [5] in jobs  # 20000 tokens: alone, over the token bound
    assert plan_jobs([]) == []

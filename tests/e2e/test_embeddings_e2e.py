"""/v1/embeddings on a real server (real GPU worker, a tiny Qwen3-Embedding-style checkpoint in
Qwen's own layout) through the OpenAI SDK: the vectors are mlx-lm's final-norm last-token states,
normalized; the SDK's default base64 transfer and `dimensions` round-trip; generation is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from model.text.tokenizer import Tokenizer
from tests.fixtures.embedding import write_embedding_model_dir
from tests.live_http import serve_in_thread

openai = pytest.importorskip("openai")

TEXTS = ["What is the capital of France?", "Paris", "A much longer passage about rivers, bridges and cafes."]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("embedding-e2e")
    official = write_embedding_model_dir(root / "official", layout="official", seed=3)
    oracle = write_embedding_model_dir(root / "oracle", layout="mlx", seed=3)  # same weights, mlx-lm's layout
    with serve_in_thread(official) as url:
        yield url, official, oracle


def reference(oracle: Path, texts: list[str]) -> list[np.ndarray]:
    model, _ = mlx_lm_load_model(oracle)
    tokenizer = Tokenizer.from_dir(oracle)
    out = []
    for text in texts:
        hidden = np.array(model.model(mx.array([tokenizer.encode(text)]))[0, -1].astype(mx.float32))
        out.append(hidden / np.linalg.norm(hidden))
    return out


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def test_sdk_embeddings_equal_mlx_lm_last_token_states(served):
    url, model_dir, oracle = served
    result = client(url).embeddings.create(model="official", input=TEXTS)  # SDK default: base64 on the wire
    assert [d.index for d in result.data] == [0, 1, 2]
    tokenizer = Tokenizer.from_dir(model_dir)
    count = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert result.usage.prompt_tokens == count and result.usage.total_tokens == count
    for item, expected in zip(result.data, reference(oracle, TEXTS)):
        vector = np.asarray(item.embedding)
        cos = float(vector @ expected / (np.linalg.norm(vector) * np.linalg.norm(expected)))
        assert cos >= 0.9999
    floats = client(url).embeddings.create(model="official", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], [d.embedding for d in result.data], atol=1e-7)


def test_sdk_dimensions_and_single_input_equal_the_batch(served):
    url, _, _ = served
    batch = client(url).embeddings.create(model="official", input=TEXTS).data
    alone = client(url).embeddings.create(model="official", input=TEXTS[2]).data[0].embedding
    np.testing.assert_allclose(alone, batch[2].embedding, atol=1e-5)
    short = client(url).embeddings.create(model="official", input=TEXTS[0], dimensions=16).data[0].embedding
    prefix = np.asarray(batch[0].embedding[:16])
    np.testing.assert_allclose(short, prefix / np.linalg.norm(prefix), atol=1e-5)


def test_sdk_errors(served):
    url, _, _ = served
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client(url).embeddings.create(model="official", input="x", dimensions=65)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client(url).chat.completions.create(model="official", messages=[{"role": "user", "content": "hi"}])

"""Load a model directory: config, family architecture, weights and tokenizer.

Must run on the thread that will use the model (MLX arrays are thread-affine).
"""

from __future__ import annotations

import logging
from pathlib import Path

import attrs
import mlx.core as mx

from model.engine.embedding import checkpoint_weights, headless_config
from model.families import build_model, family_for
from model.kernels import cuda_build
from model.load.config import ModelConfig, load_config
from model.load.embedding_config import Pooling, read_pooling
from model.load.resolve import model_name, resolve_model_dir
from model.load.weights import apply_quantization, load_into, parameter_bytes, read_weights
from model.nn.language_model import LanguageModel
from model.quant_linear import route

log = logging.getLogger(__name__)


@attrs.define
class LoadedModel:
    path: Path
    name: str
    config: ModelConfig
    model: LanguageModel
    weights_bytes: int
    kv_dtype: mx.Dtype
    pooling: Pooling | None = None  # an embedding model's (sentence-transformers files); None: generative

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype.size)


def load_model(spec: str | Path, *, name: str | None = None) -> LoadedModel:
    model_dir = resolve_model_dir(str(spec))
    config = load_config(model_dir)
    family_for(config.model_type)  # before touching gigabytes of weights
    pooling = read_pooling(model_dir, int(config.raw.get("hidden_size") or 0))
    weights = read_weights(model_dir)
    raw = config.raw
    if pooling is not None:  # official embedding checkpoints: flat backbone keys, maybe no head
        weights = checkpoint_weights(weights)
        raw = headless_config(raw, weights)
    model = build_model(config.model_type, raw, has_lm_head="lm_head.weight" in weights)
    weights = model.sanitize(weights)
    if config.quantization is not None:
        apply_quantization(model, config.quantization, weights)
    load_into(model, weights, model_dir)
    model.eval()
    cuda_build.prepare()  # CUDA: our kernels' builder probed here, eagerly (model/kernels/cuda_build.py)
    if config.quantization is not None:
        route(model)  # CUDA: few-row quantized products on our kernel (model/quant_linear.py)
    if (built := cuda_build.summary()) is not None:
        log.info("%s", built)
    return LoadedModel(
        path=model_dir,
        name=name or model_name(model_dir),
        config=config,
        model=model,
        weights_bytes=parameter_bytes(model),
        kv_dtype=model.activation_dtype(),
        pooling=pooling,
    )

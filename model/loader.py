"""Load a model directory: config, family architecture, weights and tokenizer.

Must run on the thread that will use the model (MLX arrays are thread-affine).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import mlx.core as mx

from model.config import ModelConfig, load_config
from model.errors import ModelLoadError
from model.families import check_supported, decoder_args
from model.layers import DecoderModel
from model.resolve import resolve_model_dir
from model.weights import apply_quantization, load_into, parameter_bytes, read_weights, sanitize


@attrs.define
class LoadedModel:
    path: Path
    name: str
    config: ModelConfig
    model: DecoderModel
    weights_bytes: int
    kv_dtype: mx.Dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.kv_dtype.size)


def load_model(spec: str | Path, *, name: str | None = None) -> LoadedModel:
    model_dir = resolve_model_dir(str(spec))
    config = load_config(model_dir)
    check_supported(config.model_type)  # before touching gigabytes of weights
    weights = read_weights(model_dir)
    args = decoder_args(config.model_type, config.raw, has_lm_head="lm_head.weight" in weights)
    try:
        model = DecoderModel(args)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from None
    weights = sanitize(weights, tied=args.tie_word_embeddings)
    if config.quantization is not None:
        apply_quantization(model, config.quantization, weights)
    load_into(model, weights, model_dir)
    model.eval()
    return LoadedModel(
        path=model_dir,
        name=name or model_dir.name,
        config=config,
        model=model,
        weights_bytes=parameter_bytes(model),
        kv_dtype=_activation_dtype(model),
    )


def _activation_dtype(model: DecoderModel) -> mx.Dtype:
    """KV entries take the dtype of the norms (quantized weights keep float scales/norms)."""
    return model.model.norm.weight.dtype

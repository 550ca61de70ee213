"""Is a model directory an embedding model, and how does it pool? (sentence-transformers files)

An embedding checkpoint (Qwen3-Embedding style) is a decoder plus sentence-transformers' module
list: `modules.json` names a Pooling module (usually `1_Pooling`, whose `config.json` holds the
`pooling_mode_*` flags) and, when the vectors are unit length, a Normalize module. A directory
without a Pooling module is a generative model. No MLX here: the trio side reads `Pooling` too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from model.load.errors import ModelLoadError

# sentence-transformers' flag -> our pooling mode, in the order a config with several is read.
_MODES = (
    ("pooling_mode_lasttoken", "lasttoken"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)
POOLING_MODES = tuple(mode for _, mode in _MODES)
# Modules that change the pooled vector in ways we do not run: refuse rather than return other vectors.
_UNSUPPORTED = ("Dense", "LayerNorm", "WeightedLayerPooling", "CNN", "LSTM")

# One worker job embeds at most this many inputs / padded tokens, so a large request is split and
# decode steps run between its jobs instead of stalling behind it.
JOB_MAX_INPUTS = 32
JOB_MAX_TOKENS = 16384


@attrs.frozen
class Pooling:
    """How token states become one vector: `mode` (lasttoken | mean | cls) over the final-norm
    hidden states, then unit length when `normalize`. `dimensions`: the vector's full size."""

    mode: str
    normalize: bool
    dimensions: int

    @property
    def truncatable(self) -> bool:
        """Matryoshka: a prefix of a unit vector, re-normalized, is a meaningful shorter embedding
        only for models trained that way; we allow it where the model normalizes (Qwen3-Embedding)."""
        return self.normalize


def read_pooling(model_dir: Path, hidden_size: int) -> Pooling | None:
    """The directory's pooling, or None when it is no embedding model (no Pooling module).
    `hidden_size`: config.json's (0 = unknown), the size the pooled vector must have.
    A Pooling module we cannot run exactly is a ModelLoadError, never silently other vectors."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path}: expected a list of modules")
    types = [str(m.get("type", "")) if isinstance(m, dict) else "" for m in modules]
    pooling_entries = [m for m, t in zip(modules, types) if t.rsplit(".", 1)[-1] == "Pooling"]
    if not pooling_entries:
        return None
    unsupported = [t for t in types if t.rsplit(".", 1)[-1] in _UNSUPPORTED]
    if unsupported:
        raise ModelLoadError(f"{modules_path}: unsupported sentence-transformers module {unsupported[0]!r}")
    config_path = model_dir / str(pooling_entries[0].get("path") or "1_Pooling") / "config.json"
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    mode = _mode(config, config_path)
    dimensions = int(config.get("word_embedding_dimension") or hidden_size)
    if dimensions <= 0 or (hidden_size and dimensions != hidden_size):
        raise ModelLoadError(f"{config_path}: word_embedding_dimension {dimensions} != hidden_size {hidden_size}")
    normalize = any(t.rsplit(".", 1)[-1] == "Normalize" for t in types)
    return Pooling(mode=mode, normalize=normalize, dimensions=dimensions)


def _mode(config: dict[str, Any], path: Path) -> str:
    chosen = [mode for flag, mode in _MODES if config.get(flag)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in dict(_MODES)]
    if others or len(chosen) != 1:
        found = others + chosen
        raise ModelLoadError(
            f"{path}: unsupported pooling {found or 'none'} (supported: exactly one of {', '.join(POOLING_MODES)})"
        )
    return chosen[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path.parent}: missing {path.name}") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def plan_jobs(
    lengths: Sequence[int], *, max_inputs: int = JOB_MAX_INPUTS, max_tokens: int = JOB_MAX_TOKENS
) -> list[list[int]]:
    """Input indices grouped into jobs: similar lengths together (inputs are right-padded to the
    longest of their job), at most `max_inputs` each and `max_tokens` padded tokens (an input
    longer than that runs alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    jobs: list[list[int]] = []
    for index in order:
        job = jobs[-1] if jobs else None
        # Sorted ascending: this input is the job's longest, so it sets the padded width.
        if job is None or len(job) >= max_inputs or (len(job) + 1) * lengths[index] > max_tokens:
            jobs.append([index])
        else:
            job.append(index)
    return jobs

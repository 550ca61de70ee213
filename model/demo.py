"""The embedded demo model: what `python -m actors.serve` serves when no --model is given.

It is a scripted synthetic model (see model/synth.py), generated on first use instead of
shipped, so the server works out of the box with no download and no checkpoint in the repo.
Whatever it is asked, it answers with the same few sentences saying what it is and how to serve
a real model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from model.synth import write_scripted_model_dir

DEMO_MODEL_NAME = "mlx-trio-demo (embedded demo model)"

# Bump when the script or shape changes, so an old cached copy is never reused.
DEMO_VERSION = "demo-v1"

# One token per piece; pieces must be unique, hence the varied chunking.
DEMO_SCRIPT = (
    "Hello!",
    " I am the",
    " embedded demo model",
    " of mlx-trio:",
    " a tiny synthetic network",
    " that always says",
    " these same words.",
    " To chat with",
    " a real model,",
    " restart the server",
    " with --model",
    " <path or Hugging Face repo id>",
    ".",
)

_COMPLETE_MARKER = ".complete"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
)


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the demo model lives: `<cache_dir>/demo-v1`, cache_dir defaulting to
    $MLX_TRIO_CACHE or ~/.cache/mlx-trio."""
    if cache_dir is None:
        env = os.environ.get("MLX_TRIO_CACHE")
        cache_dir = Path(env) if env else Path.home() / ".cache" / "mlx-trio"
    return Path(cache_dir) / DEMO_VERSION


def write_demo_model(path: Path) -> Path:
    return write_scripted_model_dir(
        path,
        DEMO_SCRIPT,
        family="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        template="chatml",
        seed=0,
    )


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file() and all((model_dir / f).is_file() for f in _REQUIRED_FILES)


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model directory, generating it first if it is missing or incomplete.

    Generation writes into a sibling temp dir and renames it into place, so a crash never
    leaves a half-written model that a later start would trust, and two servers starting at
    once both end up with the same complete copy.
    """
    target = demo_model_dir(cache_dir)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=target.parent))
    try:
        write_demo_model(staging)
        (staging / _COMPLETE_MARKER).write_text(DEMO_MODEL_NAME + "\n", encoding="utf-8")
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another process renamed its copy in first; theirs is as good as ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

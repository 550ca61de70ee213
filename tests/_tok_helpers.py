"""Shared helpers for the tokenizer tests: tiny tokenizer dirs and the transformers oracle."""

from __future__ import annotations

import os
from pathlib import Path

from tests.fixtures.synth_tokenizer import write_tokenizer_files

# The oracle must never reach for the network, even if a test passes a name by mistake.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SAMPLE_TEXTS = [
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
    "Café naïve façade — crème brûlée, déjà vu.",
    "你好，世界！今天天气很好。",
    "Emoji 😀🎉🚀 👍🏽 ❤️ 🇫🇷 and more: 🦄🧪",
    "Mixed: Привет 東京 한국어 Straße ∞ → ±",
    "  leading and trailing spaces  \n\n\ttabs\t",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>",
    "numbers 3.14159 2025-01-31 1000000",
]


def make_tokenizer_dir(root: Path, name: str = "tok", **kwargs) -> Path:
    path = root / name
    write_tokenizer_files(path, **kwargs)
    return path


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

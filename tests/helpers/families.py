"""Tests parametrized over every synthesized family (tests/fixtures/synth.py FAMILIES) run one
family per cache layout in the default run and the rest under `slow`: a dense model, MoE experts,
recurrent-state layers, sliding-window layers and shared-KV layers each stay covered on every run,
and the families that repeat one of those layouts (llama, mistral, qwen2, Gemma 4's k=v variant,
Qwen3.5's MoE, Qwen3-Next) wait for the full run (`-m "slow or not slow"`)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures.synth import FAMILIES

# One family per cache layout: dense, MoE, recurrent state, sliding window, shared KV.
LAYOUTS = ("qwen3", "qwen3_moe", "qwen3_5", "gemma3_text", "gemma4_text")


def every_family() -> list[Any]:
    """pytest parameters: every family, those outside `LAYOUTS` marked slow."""
    return [f if f in LAYOUTS else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]

"""A batch's prefill through quantized routed experts (model/prefill_dequant.py), checked on the CPU with
the CUDA device stood in for: where the load-time measurement found dequantize + gather_mm faster,
a batch's prefill takes it (with gather_qmm's values), while one sequence's prefill, decode steps
and token counts below the measured threshold keep gather_qmm; the measurement sets the smallest
count that still won, and a path that disagrees is never taken."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from model import prefill_dequant, quant_kernel, quant_linear, quant_tune
from model.moe import SwitchGLU, expert_shape
from model.quant_linear import KernelQuantizedLinear, dense_shape

D, H, E, TOP = 128, 64, 8, 2


def quantized_glu() -> SwitchGLU:
    glu = SwitchGLU(D, H, E)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(glu, name, getattr(glu, name).to_quantized(group_size=64, bits=4))
    return glu


@pytest.fixture
def calls(monkeypatch) -> Counter[str]:
    """A CUDA device stood in for, no measurement yet, and a count of MLX's gather calls."""
    monkeypatch.setattr(quant_kernel, "available", lambda: True)
    monkeypatch.setattr(prefill_dequant, "_thresholds", {})
    monkeypatch.setattr(prefill_dequant, "_weight_bytes", {})
    counted: Counter[str] = Counter()
    for name in ("gather_qmm", "gather_mm", "quantized_matmul", "dequantize"):
        real = getattr(mx, name)

        def spy(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> mx.array:
            counted[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mx, name, spy)
    return counted


def routed(tokens_shape: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    x = mx.random.normal((*tokens_shape, D), key=mx.random.key(1))
    indices = mx.argsort(mx.random.uniform(shape=(*tokens_shape, E), key=mx.random.key(2)), axis=-1)[..., :TOP]
    return x, indices


def test_a_batch_prefill_takes_the_dequantized_experts_from_the_measured_count(calls, monkeypatch):
    glu = quantized_glu()
    for p in (glu.gate_proj, glu.up_proj, glu.down_proj):
        prefill_dequant._thresholds[prefill_dequant._key(expert_shape(p, mx.float32))] = 100
    batch = routed((2, 60))  # 120 tokens: past the few-row kernel, past the threshold
    got = glu(*batch)
    assert calls == {"gather_mm": 3, "dequantize": 3}
    with monkeypatch.context() as m:
        m.setattr(quant_kernel, "available", lambda: False)
        want = glu(*batch)
    assert got.shape == want.shape and mx.allclose(got, want, rtol=1e-4, atol=1e-4)
    for shape in ((1, 120), (2, 40), (70, 1)):  # one sequence; below the threshold; a decode step
        calls.clear()
        glu(*routed(shape))
        assert calls == {"gather_qmm": 3}, shape


def test_a_batch_prefill_through_a_dense_linear_takes_the_dequantized_weight(calls, monkeypatch):
    monkeypatch.setattr(quant_kernel, "_verdicts", {})
    lin = nn.QuantizedLinear(D, H, bias=True, group_size=64, bits=4)
    lin.__class__ = KernelQuantizedLinear
    prefill_dequant._thresholds[prefill_dequant._key(dense_shape(lin, mx.float32))] = 100
    x = mx.random.normal((2, 60, D), key=mx.random.key(3))
    got = lin(x)
    assert calls == {"dequantize": 1}
    with monkeypatch.context() as m:
        m.setattr(quant_kernel, "available", lambda: False)
        want = lin(x)
    assert got.shape == want.shape == (2, 60, H) and mx.allclose(got, want, rtol=1e-4, atol=1e-4)
    for shape in ((1, 120), (2, 40)):  # one sequence; below the threshold (a decode step: the kernel)
        calls.clear()
        lin(mx.random.normal((*shape, D)))
        assert calls == {"quantized_matmul": 1}, shape


def fake_times(monkeypatch, dequantized_wins_at: set[int], top: int = TOP) -> None:
    """`_time` answers by which path is timed: the dequantized one faster at those token counts
    (of `top` experts each)."""

    def timed(call: Any, reps: int = 0, queue: int = 0) -> float:
        x = call.args[0]
        tokens = x.shape[0] // top if x.ndim == 3 else x.shape[0]  # (pairs [P, 1, K] or rows [T, K])
        faster = tokens in dequantized_wins_at
        dequantized = call.func in (prefill_dequant.expert_product, prefill_dequant.dense_product)
        return 1.0 if dequantized == faster else 2.0

    monkeypatch.setattr(prefill_dequant, "_time", timed)


def test_the_threshold_is_the_smallest_count_that_won_downwards(monkeypatch):
    monkeypatch.setattr(prefill_dequant, "_thresholds", {})
    monkeypatch.setattr(prefill_dequant, "_weight_bytes", {})
    shapes = [(E, H, D, 4, 64, mx.float32), (E, D, H, 4, 64, mx.float32), (4, H, D, 8, 64, mx.float32)]
    dense = (0, H, D, 4, 64, mx.float32)
    fake_times(monkeypatch, {64, 32})
    report = prefill_dequant.tune(shapes[:1], tokens=(16, 64, 32), top_k=TOP)
    assert prefill_dequant._thresholds[prefill_dequant._key(shapes[0])] == 32
    (entry,) = report.values()
    assert sorted(entry["tokens"]) == [16, 32, 64]  # measured down to the first loss
    fake_times(monkeypatch, {32})  # lost at the largest count: never, and nothing below is timed
    report = prefill_dequant.tune(shapes[1:2], tokens=(16, 64, 32), top_k=TOP)
    assert prefill_dequant._thresholds[prefill_dequant._key(shapes[1])] is None
    assert sorted(next(iter(report.values()))["tokens"]) == [64]
    fake_times(monkeypatch, {64, 32})
    prefill_dequant.tune([dense], tokens=(16, 64, 32), top_k=TOP)  # a dense weight: its rows
    assert prefill_dequant._thresholds[prefill_dequant._key(dense)] == 32
    monkeypatch.setattr(prefill_dequant, "_rel_err", lambda got, want: 1.0)  # a path that disagrees
    report = prefill_dequant.tune(shapes[2:], tokens=(16,), top_k=TOP)
    assert prefill_dequant._thresholds[prefill_dequant._key(shapes[2])] is None
    assert "differs from MLX's op" in next(iter(report.values()))["failed"]
    # Admission bills three dequantized weights where the path is on (fp32 here): the largest.
    assert prefill_dequant.transient_bytes() == 3 * E * H * D * 4
    monkeypatch.setattr(prefill_dequant, "_thresholds", {prefill_dequant._key(shapes[1]): None})
    assert prefill_dequant.transient_bytes() == 0
    monkeypatch.setattr(prefill_dequant, "_thresholds", dict.fromkeys(map(prefill_dequant._key, shapes[:2]), 32))
    monkeypatch.setitem(prefill_dequant._thresholds, prefill_dequant._key(shapes[1]), None)
    line = prefill_dequant.summary(shapes, {})
    assert "experts 8x64x128 q4: dequantized from 32 tokens" in line and "experts 8x128x64 q4: MLX's op" in line


def test_route_measures_the_experts_and_logs_the_thresholds(calls, monkeypatch, caplog):
    monkeypatch.setattr(quant_tune, "tune", lambda shapes, *a, **k: {})
    monkeypatch.setattr(quant_tune, "tune_gather", lambda shapes, *a, **k: {})
    fake_times(monkeypatch, {2048, 512, 128}, top=E)  # (route measures 8 experts a token)
    model = nn.Module()
    model.glu = quantized_glu()
    model.proj = nn.QuantizedLinear(D, H, bias=False, group_size=64, bits=4)
    model.lm_head = nn.QuantizedLinear(D, 4 * H, bias=False, group_size=64, bits=4)  # (prefill stops before it)
    with caplog.at_level(logging.INFO, logger="model.quant_linear"):
        quant_linear.route(model)
    assert "batch prefill through quantized weights" in caplog.text
    for name in ("experts 8x128x64 q4", "experts 8x64x128 q4", "): 64x128 q4"):
        assert f"{name}: dequantized from 128 tokens" in caplog.text, name
    assert len(prefill_dequant._thresholds) == 3  # gate/up share a shape; down its own; the dense one

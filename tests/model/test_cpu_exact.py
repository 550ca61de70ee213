"""model.kernels.cpu_swiglu: the CPU SwiGLU must give MLX's own bits, not merely close ones."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from model.kernels import cpu_swiglu
from model.nn.decoder import swiglu

pytestmark = pytest.mark.skipif(mx.default_device().type != mx.cpu, reason="the CPU backend's formula")


def _same_bits(a: mx.array, b: mx.array) -> bool:
    return np.array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


def _inputs() -> mx.array:
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(200_000) * s for s in (0.01, 1.0, 4.0, 30.0, 100.0)]
    # Every exponent band, both signs, and the edges of the polynomial's clamps.
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    parts.append(bits.view(np.float32))
    parts.append(
        np.array(
            [
                0.0,
                -0.0,
                88.0,
                -88.0,
                88.0001,
                -88.0001,
                87.9999,
                -87.9999,
                1e-45,
                -1e-45,
                np.inf,
                -np.inf,
                np.nan,
                3.4e38,
                -3.4e38,
            ],
            np.float32,
        )
    )
    return mx.array(np.concatenate([p.astype(np.float32) for p in parts]))


def test_exp_and_sigmoid_are_mlx_bit_for_bit():
    x = _inputs()
    assert _same_bits(cpu_swiglu.exp_f32(x), mx.exp(x))
    assert _same_bits(cpu_swiglu.sigmoid_f32(x), mx.sigmoid(x))


def test_swiglu_is_mlx_lm_bit_for_bit_at_every_shape():
    x = _inputs()
    for shape in ((1, 7, 64), (3, 1, 128), (2, 33, 96)):
        n = int(np.prod(shape))
        gate = x[:n].reshape(shape)
        up = mx.random.normal(shape, key=mx.random.key(n))
        assert cpu_swiglu.applies(gate, up)
        assert _same_bits(swiglu(gate, up), nn.silu(gate) * up)


def test_a_large_swiglu_in_row_pieces_is_still_mlx_lm_bit_for_bit(monkeypatch):
    x = _inputs()
    calls = []
    real = cpu_swiglu.swiglu_f32
    monkeypatch.setattr(cpu_swiglu, "swiglu_f32", lambda g, u: (calls.append(g.shape), real(g, u))[1])
    for piece, shape in ((cpu_swiglu.PIECE_ELEMENTS, (3, 301, 512)), (1000, (2, 37, 96))):
        monkeypatch.setattr(cpu_swiglu, "PIECE_ELEMENTS", piece)
        calls.clear()
        n = int(np.prod(shape))
        gate = x[:n].reshape(shape)
        up = mx.random.normal(shape, key=mx.random.key(n))
        out = swiglu(gate, up)
        step = piece // shape[-1]
        rows = n // shape[-1]
        assert len(calls) == -(-rows // step) and calls[0] == (step, shape[-1]), calls  # really in pieces
        assert out.shape == shape and _same_bits(out, nn.silu(gate) * up)


def test_other_dtypes_keep_mlx_silu():
    gate = mx.random.normal((2, 5, 64)).astype(mx.bfloat16)
    up = mx.random.normal((2, 5, 64)).astype(mx.bfloat16)
    assert not cpu_swiglu.applies(gate, up)
    assert mx.array_equal(swiglu(gate, up), nn.silu(gate) * up).item()

"""The CUDA kernels of a decode step's LoRA delta (model/lora_kernel.py), on a CUDA GPU only: `x @ A`
and `y` plus the masked, scaled delta equal float32 matmuls, and a row's result does not depend
on the rows batched with it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model import lora_kernel

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels: needs an NVIDIA GPU")


def rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def operands(rows: int, k: int, r: int, n: int, dtype: mx.Dtype) -> list[mx.array]:
    mx.random.seed(rows * 1000 + r)
    x = mx.random.normal((rows, k)).astype(dtype)
    a = (mx.random.normal((k, r)) * 0.02).astype(dtype)
    b = (mx.random.normal((r, n)) * 0.02).astype(dtype)
    y = mx.random.normal((rows, n)).astype(dtype)
    return [x, a, b, y]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(("rows", "k", "r"), [(1, 4096, 16), (3, 2048, 48), (8, 14336, 64), (8, 4096, 768)])
def test_times_a_equals_a_float32_matmul(rows, k, r, dtype):
    x, a, _, _ = operands(rows, k, r, 8, dtype)
    assert lora_kernel.usable(x, a)
    got = lora_kernel.times_a(x, a)
    assert got.shape == (rows, r) and got.dtype == dtype
    assert rel_err(got, x.astype(mx.float32) @ a.astype(mx.float32)) < (1e-2 if dtype == mx.bfloat16 else 1e-5)


@pytest.mark.parametrize("mask_rows", [1, 8])
@pytest.mark.parametrize(("k", "r", "width"), [(4096, 48, 16), (2048, 64, 64)])
def test_add_delta_equals_the_float32_expression(k, r, width, mask_rows):
    rows, n = 8, 1536
    x, a, b, y = operands(rows, k, r, n, mx.bfloat16)
    mask = (mx.random.uniform(shape=(mask_rows, width)) > 0.5).astype(mx.bfloat16)
    scale = mx.full((mask_rows, 1), 2.0, mx.bfloat16)
    got = lora_kernel.add_delta(y, x, a, b, mask, scale)
    f = [v.astype(mx.float32) for v in (x, a, b, y, mask, scale)]
    z = ((f[0] @ f[1]).reshape(rows, -1, width) * f[4][:, None]).reshape(rows, r)
    assert got.dtype == mx.bfloat16
    assert rel_err(got, f[3] + f[5] * (z @ f[2])) < 1e-2


def test_a_rows_result_does_not_depend_on_its_batch():
    x, a, b, y = operands(8, 4096, 64, 1024, mx.bfloat16)
    mask = mx.ones((8, 64), mx.bfloat16)
    scale = mx.full((8, 1), 0.5, mx.bfloat16)
    together = lora_kernel.times_a(x, a)
    added = lora_kernel.add_delta(y, x, a, b, mask, scale)
    for i in (0, 5):
        alone = lora_kernel.times_a(x[i : i + 1], a)
        assert mx.array_equal(alone, together[i : i + 1]).item()
        one = lora_kernel.add_delta(y[i : i + 1], x[i : i + 1], a, b, mask[i : i + 1], scale[i : i + 1])
        assert mx.array_equal(one, added[i : i + 1]).item()


def test_shapes_it_does_not_tile_are_refused():
    assert not lora_kernel.usable(mx.zeros((9, 4096)), mx.zeros((4096, 16)))  # more rows than a decode step
    assert not lora_kernel.usable(mx.zeros((1, 4100)), mx.zeros((4100, 16)))  # K not a multiple of a chunk
    assert not lora_kernel.usable(mx.zeros((1, 4096)), mx.zeros((4096, 2048)))  # too many columns

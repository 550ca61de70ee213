"""The CUDA kernels of a decode step's LoRA delta (model/lora/kernel.py), on a CUDA GPU only: `x @ A`
and `y` plus the masked, scaled delta equal float32 products computed on the CPU (the GPU's own
float32 matmul may round through TF32), columns no row uses come out exactly 0, and a row's
result does not depend on the rows batched with it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from model.lora import kernel as lora_kernel

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels: needs an NVIDIA GPU")


def rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def operands(rows: int, k: int, r: int, n: int, dtype: mx.Dtype) -> list[mx.array]:
    mx.random.seed(rows * 1000 + r)
    x = mx.random.normal((rows, k)).astype(dtype)
    at = (mx.random.normal((r, k)) * 0.02).astype(dtype)
    b = (mx.random.normal((r, n)) * 0.02).astype(dtype)
    y = mx.random.normal((rows, n)).astype(dtype)
    return [x, at, b, y]


def on_cpu(*arrays: mx.array) -> list[mx.array]:
    out = [a.astype(mx.float32) for a in arrays]
    mx.eval(out)
    return out


def expected(x, at, b, y, mask, scale) -> mx.array:  # type: ignore[no-untyped-def]
    """The float32 expression of model/lora/delta.py, on the CPU."""
    x, at, b, y, mask, scale = on_cpu(x, at, b, y, mask, scale)
    with mx.stream(mx.cpu):
        rows, width = x.shape[0], mask.shape[-1]
        z = ((x @ at.T).reshape(rows, -1, width) * mask[:, None]).reshape(rows, -1)
        out = y + scale * (z @ b)
        mx.eval(out)
    return out


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(("rows", "k", "r"), [(1, 4096, 16), (3, 2048, 48), (8, 14336, 64), (8, 4096, 768)])
def test_times_a_equals_a_float32_product(rows, k, r, dtype):
    x, at, b, _ = operands(rows, k, r, 8, dtype)
    assert lora_kernel.usable(x, at, b)
    got = lora_kernel.times_a(x, at, mx.ones((1, r), dtype))
    assert got.shape == (rows, r) and got.dtype == mx.float32
    xf, af = on_cpu(x, at)
    with mx.stream(mx.cpu):
        want = xf @ af.T
        mx.eval(want)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("mask_rows", [1, 8])
@pytest.mark.parametrize(("k", "r", "width"), [(4096, 48, 16), (2048, 64, 64), (14336, 96, 32)])
def test_add_delta_equals_the_float32_expression(k, r, width, mask_rows, dtype):
    rows, n = 8, 1536
    x, at, b, y = operands(rows, k, r, n, dtype)
    mask = (mx.random.uniform(shape=(mask_rows, width)) > 0.5).astype(dtype)
    scale = mx.full((mask_rows, 1), 2.0, dtype)
    got = lora_kernel.add_delta(y, x, at, b, mask, scale)
    assert got.dtype == dtype and got.shape == y.shape
    # bfloat16: one rounding of the float32 result; float32: summation order only
    assert rel_err(got, expected(x, at, b, y, mask, scale)) < (1e-2 if dtype == mx.bfloat16 else 1e-5)


def test_rows_on_no_adapter_keep_y_exactly_and_unused_columns_are_zero():
    x, at, b, y = operands(4, 4096, 64, 1024, mx.bfloat16)
    mask = mx.zeros((4, 16), mx.bfloat16)
    mask[1, :] = 1.0  # row 1 on every column, the others on none
    scale = mx.full((4, 1), 2.0, mx.bfloat16)
    got = lora_kernel.add_delta(y, x, at, b, mask, scale)
    for row in (0, 2, 3):
        assert mx.array_equal(got[row], y[row]).item()
    assert not mx.array_equal(got[1], y[1]).item()
    one_row = mx.zeros((1, 32), mx.bfloat16)
    one_row[0, :8] = 1.0
    z = lora_kernel.times_a(x, at, one_row)  # columns 8-31 and 40-63 unused by every row
    assert (z[:, 8:32] == 0).all().item() and (z[:, 40:] == 0).all().item()
    assert (z[:, :8] != 0).any().item()


def test_a_rows_result_does_not_depend_on_its_batch():
    x, at, b, y = operands(8, 4096, 64, 1024, mx.bfloat16)
    mask = mx.ones((8, 64), mx.bfloat16)
    scale = mx.full((8, 1), 0.5, mx.bfloat16)
    together = lora_kernel.times_a(x, at, mask)
    added = lora_kernel.add_delta(y, x, at, b, mask, scale)
    for i in (0, 5):
        alone = lora_kernel.times_a(x[i : i + 1], at, mask[i : i + 1])
        assert mx.array_equal(alone, together[i : i + 1]).item()
        one = lora_kernel.add_delta(y[i : i + 1], x[i : i + 1], at, b, mask[i : i + 1], scale[i : i + 1])
        assert mx.array_equal(one, added[i : i + 1]).item()


def test_shapes_it_does_not_tile_are_refused():
    b = mx.zeros((16, 64))
    assert not lora_kernel.usable(mx.zeros((9, 4096)), mx.zeros((16, 4096)), b)  # more rows than a decode step
    assert not lora_kernel.usable(mx.zeros((1, 4100)), mx.zeros((16, 4100)), b)  # K not whole groups of 8
    assert not lora_kernel.usable(mx.zeros((1, 4096)), mx.zeros((2048, 4096)), mx.zeros((2048, 64)))  # too wide
    assert not lora_kernel.usable(mx.zeros((1, 4096)), mx.zeros((16, 4096)), mx.zeros((16, 60)))  # N not whole groups

"""The quantized-matmul CUDA kernels (model/quant_kernel.py), on a CUDA GPU only: the dense product
and the routed-experts product equal MLX's own `quantized_matmul` / `gather_qmm` within bf16
rounding for 1-64 rows, 4 and 8 bits, every group size, every tiling (clusters included), and a
row's result does not depend on the rows batched with it. The routing (model/quant_linear.py,
model/moe.py) takes the kernel for a batch of rows and MLX's op for one row or a solo prefill.
The index arithmetic is checked on the CPU too (test_quant_kernel_emulation.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from model import quant_kernel
from model.moe import QuantizedSwitchLinear, SwitchGLU
from model.quant_linear import KernelQuantizedLinear, route

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels: needs an NVIDIA GPU")


def rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def weights(n: int, k: int, bits: int, gs: int, dtype=mx.bfloat16, experts: int = 0, seed: int = 0):  # type: ignore[no-untyped-def]
    shape = (experts, n, k) if experts else (n, k)
    w = (mx.random.normal(shape, key=mx.random.key(seed)) * 0.02).astype(dtype)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


def reference(x: mx.array, q: mx.array, s: mx.array, b: mx.array, bits: int, gs: int) -> mx.array:
    """float32 activations times the dequantized weights, on the CPU."""
    with mx.stream(mx.cpu):
        w = mx.dequantize(q, s, b, group_size=gs, bits=bits).astype(mx.float32)
        out = x.astype(mx.float32) @ w.swapaxes(-1, -2)
        mx.eval(out)
    return out


SHAPES = [(4096, 4096), (1024, 4096), (512, 14336), (384, 2048), (2048, 768)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_dense_equals_mlx_within_bf16_rounding(n, k, bits, gs):
    if quant_kernel.config_for(n, k, bits) is None:
        pytest.skip("shape does not tile")
    q, s, b = weights(n, k, bits, gs, seed=n + k)
    for rows in (1, 2, 8, 13, 32, 64):
        x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
        got = quant_kernel.qmm(x, q, s, b, bits)
        mlx = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)
        want = reference(x, q, s, b, bits, gs)
        assert got.shape == (rows, n) and got.dtype == mx.bfloat16
        assert rel_err(got, want) < 1e-2, (rows, rel_err(got, want))
        assert rel_err(got, mlx) < 1.5e-2, (rows, rel_err(got, mlx))


def test_every_tiling_agrees():
    n, k, gs, bits = 1024, 4096, 64, 4
    q, s, b = weights(n, k, bits, gs)
    x = mx.random.normal((24, k), key=mx.random.key(3)).astype(mx.bfloat16)
    want = reference(x, q, s, b, bits, gs)
    for cfg in quant_kernel._candidates(n, k, bits) + [quant_kernel.Config(8, 1, 1, u=3)]:
        got = quant_kernel.qmm(x, q, s, b, bits, cfg)
        assert rel_err(got, want) < 1e-2, cfg


def test_float16():
    n, k, bits, gs = 1024, 2048, 4, 64
    q, s, b = weights(n, k, bits, gs, dtype=mx.float16)
    x = mx.random.normal((8, k), key=mx.random.key(5)).astype(mx.float16)
    got = quant_kernel.qmm(x, q, s, b, bits)
    assert got.dtype == mx.float16
    assert rel_err(got, reference(x, q, s, b, bits, gs)) < 5e-3


def test_a_rows_result_does_not_depend_on_its_batch():
    n, k, bits, gs = 4096, 4096, 4, 64
    q, s, b = weights(n, k, bits, gs)
    x = mx.random.normal((48, k), key=mx.random.key(9)).astype(mx.bfloat16)
    together = quant_kernel.qmm(x, q, s, b, bits)
    for i in (0, 17, 47):
        alone = quant_kernel.qmm(x[i : i + 1], q, s, b, bits)
        pair = quant_kernel.qmm(x[i : i + 2] if i < 47 else x[i - 1 : i + 1], q, s, b, bits)
        assert mx.array_equal(alone[0], together[i]).item()
        assert mx.array_equal(pair[0 if i < 47 else 1], together[i]).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_gather_equals_mlx_gather_qmm(bits, gs):
    experts, n, k = 16, 384, 2048
    q, s, b = weights(n, k, bits, gs, experts=experts, seed=1)
    for tokens, top in ((2, 4), (7, 2), (32, 8), (64, 8)):
        x = mx.random.normal((tokens, k), key=mx.random.key(tokens)).astype(mx.bfloat16)
        idx = mx.argsort(mx.random.uniform(shape=(tokens, experts), key=mx.random.key(tokens + 1)), axis=-1)[:, :top]
        flat = idx.flatten()
        order = mx.argsort(flat)
        sorted_experts, rowmap = flat[order], order // top
        got = quant_kernel.gather_qmm(x, q, s, b, rowmap, sorted_experts, bits, rows_per_expert=min(tokens, 16))
        want = mx.gather_qmm(
            x[rowmap][:, None], q, s, b, rhs_indices=sorted_experts, transpose=True, group_size=gs, bits=bits
        ).squeeze(1)
        assert got.shape == (tokens * top, n)
        assert rel_err(got, want) < 1.5e-2, (tokens, rel_err(got, want))


def test_gather_rows_past_a_blocks_capacity():
    experts, n, k, bits, gs = 4, 256, 1024, 4, 64
    q, s, b = weights(n, k, bits, gs, experts=experts, seed=2)
    x = mx.random.normal((40, k), key=mx.random.key(1)).astype(mx.bfloat16)
    sorted_experts = mx.array([0] * 3 + [2] * 37, mx.uint32)  # 37 rows on one expert, 8 at a time
    rowmap = mx.arange(40, dtype=mx.uint32)
    got = quant_kernel.gather_qmm(x, q, s, b, rowmap, sorted_experts, bits, rows_per_expert=8)
    want = mx.concatenate([reference(x[:3], q[0], s[0], b[0], bits, gs), reference(x[3:], q[2], s[2], b[2], bits, gs)])
    assert rel_err(got, want) < 1e-2


def test_linear_routing_takes_the_kernel_for_a_batch_only(monkeypatch):
    lin = nn.QuantizedLinear(2048, 1024, bias=True, group_size=64, bits=4)
    lin.bias = mx.random.normal((1024,)).astype(mx.bfloat16)
    lin.scales, lin.biases = lin.scales.astype(mx.bfloat16), lin.biases.astype(mx.bfloat16)
    model = nn.Sequential(lin)
    assert route(model, tune=False) == 1 and type(lin) is KernelQuantizedLinear
    calls = []
    real = quant_kernel.qmm
    monkeypatch.setattr(quant_kernel, "qmm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    batch = mx.random.normal((8, 1, 2048)).astype(mx.bfloat16)
    got = lin(batch)
    want = mx.quantized_matmul(batch, lin.weight, lin.scales, lin.biases, group_size=64, bits=4) + lin.bias
    assert rel_err(got, want) < 1.5e-2 and calls == [(8, 1, 2048)]
    lin(mx.random.normal((1, 1, 2048)).astype(mx.bfloat16))  # one row: MLX's
    lin(mx.random.normal((1, 12, 2048)).astype(mx.bfloat16))  # a solo prefill: MLX's
    lin(mx.random.normal((2, 12, 2048)).astype(mx.bfloat16))  # a group prefill of 24 rows: ours
    assert calls == [(8, 1, 2048), (2, 12, 2048)]


def test_switch_glu_on_the_kernel_equals_mlx():
    dims, hidden, experts, top = 2048, 768, 32, 8
    glu = SwitchGLU(dims, hidden, experts)
    for name in ("gate_proj", "up_proj", "down_proj"):
        p = getattr(glu, name)
        p.weight = (p.weight * 0.5).astype(mx.bfloat16)
        setattr(glu, name, p.to_quantized(group_size=64, bits=4))
        assert type(getattr(glu, name)) is QuantizedSwitchLinear
    x = mx.random.normal((16, 1, dims)).astype(mx.bfloat16)
    idx = mx.argsort(mx.random.uniform(shape=(16, 1, experts)), axis=-1)[..., :top]
    got = glu(x, idx)
    assert got.shape == (16, 1, top, dims)
    quant_kernel.ENABLED = False
    try:
        want = glu(x, idx)
    finally:
        quant_kernel.ENABLED = True
    assert rel_err(got, want) < 2e-2

"""The quantized-matmul CUDA kernels (model/quant_kernel.py), on a CUDA GPU only: the dense product
and the routed-experts product equal MLX's own `quantized_matmul` / `gather_qmm` within bf16
rounding for 1-64 rows, 4 and 8 bits, every group size and each code path of the tilings
(clusters included), and a row's result does not depend on the rows batched with it. The routing
(model/quant_linear.py, model/moe.py) takes the kernel for a batch of rows and MLX's op for one
row or a solo prefill. The index arithmetic is checked on the CPU too
(test_quant_kernel_emulation.py).

Each kernel (dtype, bits, row bucket, tiling, dense or routed) is an NVRTC compile, so the grid
is a representative subset, not the product: group sizes are read at run time (every test sweeps
them for free), and the row buckets (1-8, 9-16, 17-32, 33-64 rows) are all run at 4 bits and the
smallest and largest at 8. `PLAN` lists the 12 kernels (on a GPU with thread-block clusters); they
are smoke-run in child processes first (tests/helpers/cuda_smoke.py), so one that hangs or fails
to compile fails its tests by name instead of stalling the suite."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from model import quant_kernel
from model.moe import QuantizedSwitchLinear, SwitchGLU
from model.quant_linear import KernelQuantizedLinear, route
from tests.helpers import cuda_smoke

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels: needs an NVIDIA GPU")

DENSE = (4096, 4096)  # Llama-3-8B's q/o projection
# bits -> group size -> row counts: every group size, and every row bucket at 4 bits (1, 2, 4
# or 8 tiles of 8 rows); the smallest and largest bucket at 8 bits.
DENSE_ROWS = {
    4: {32: (1, 13, 64), 64: (2, 32, 48), 128: (8, 17, 64)},
    8: {32: (1, 40), 64: (5, 64), 128: (8, 33)},
}
TILING_SHAPE, TILING_ROWS = (1024, 4096), 13  # Llama-3-8B's k/v projection
EXPERTS = (16, 384, 2048)  # experts, N, K
GATHER_ROWS_PER_EXPERT = {4: 16, 8: 8}  # the routed product's block capacity: 2 tiles at 4 bits, 1 at 8
GLU = (2048, 768, 32, 8)  # dims, hidden, experts, top k


def tilings() -> list[quant_kernel.Config]:
    """One tiling per code path: no split of K (each warp writes its outputs), K over the block's
    warps (shared-memory reduction) and the shape's own choice (on sm_90: K over a cluster too)."""
    n, k = TILING_SHAPE
    chosen = quant_kernel.config_for(n, k, 4)
    assert chosen is not None
    out = [quant_kernel.Config(8, 1, 1), quant_kernel.Config(4, 2, 1)]
    return out + ([chosen] if chosen not in out else [])


def plan() -> set[cuda_smoke.Spec]:
    """Every kernel this module builds (the guard fails a test that builds another)."""
    bf16, spec = mx.bfloat16, cuda_smoke.qmm_spec
    dense = quant_kernel.config_for(*DENSE, 4), quant_kernel.config_for(*DENSE, 8)
    assert dense[0] is not None and dense[1] is not None
    out = {spec(bf16, 4, quant_kernel._maxnt(r), dense[0], False) for rows in DENSE_ROWS[4].values() for r in rows}
    out |= {spec(bf16, 8, quant_kernel._maxnt(r), dense[1], False) for rows in DENSE_ROWS[8].values() for r in rows}
    out |= {spec(bf16, 4, quant_kernel._maxnt(TILING_ROWS), cfg, False) for cfg in tilings()}
    out.add(spec(mx.float16, 4, 1, dense[0], False))  # test_float16: 8 rows
    out |= {spec(bf16, 4, quant_kernel._maxnt(r), dense[0], False) for r in (1, 2, 8, 24, 48)}  # batch, routing
    gathered = [(EXPERTS[1], EXPERTS[2], 4), (EXPERTS[1], EXPERTS[2], 8), (256, 1024, 8)]  # + past capacity
    gathered += [(GLU[1], GLU[0], 4), (GLU[0], GLU[1], 4)]  # SwitchGLU's gate/up and down
    for n, k, bits in gathered:
        cfg = quant_kernel.gather_config_for(n, k, bits)
        assert cfg is not None
        out.add(spec(bf16, bits, quant_kernel._maxnt(GATHER_ROWS_PER_EXPERT[bits]), cfg, True))
    return out


@pytest.fixture(scope="module")
def smoked(request: pytest.FixtureRequest) -> dict[cuda_smoke.Spec, cuda_smoke.Outcome]:
    start = time.perf_counter()
    outcomes = cuda_smoke.run(plan())
    cuda_smoke.report(request.config, "test_quant_kernel.py", outcomes, time.perf_counter() - start)
    return outcomes


@pytest.fixture(autouse=True)
def guarded(smoked: dict[cuda_smoke.Spec, cuda_smoke.Outcome], monkeypatch: pytest.MonkeyPatch) -> None:
    def spec_of(dtype: mx.Dtype, bits: int, maxnt: int, cfg: quant_kernel.Config, gather: bool) -> cuda_smoke.Spec:
        return cuda_smoke.qmm_spec(dtype, bits, maxnt, cfg, gather)

    cuda_smoke.guard(monkeypatch, quant_kernel, spec_of, smoked)


def rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def weights(n: int, k: int, bits: int, gs: int, dtype=mx.bfloat16, experts: int = 0, seed: int = 0):  # type: ignore[no-untyped-def]
    shape = (experts, n, k) if experts else (n, k)
    w = (mx.random.normal(shape, key=mx.random.key(seed)) * 0.02).astype(dtype)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


def dequantized(q: mx.array, s: mx.array, b: mx.array, bits: int, gs: int) -> mx.array:
    """The weights in float32, on the CPU (for `reference`)."""
    with mx.stream(mx.cpu):
        w = mx.dequantize(q, s, b, group_size=gs, bits=bits).astype(mx.float32)
        mx.eval(w)
    return w


def on_cpu(fn):  # type: ignore[no-untyped-def]
    """`fn()` evaluated on the CPU: MLX's own quantized ops as the reference. On CUDA, MLX's op
    for more than a few rows is a CUTLASS kernel built by NVRTC at first use, ~20 s for each
    tile, group size and bit width: a sweep of them outlasted the whole GPU call."""
    with mx.stream(mx.cpu):
        out = fn()
        mx.eval(out)
    return out


def reference(x: mx.array, w32: mx.array) -> mx.array:
    """float32 activations times float32 weights, on the CPU."""
    with mx.stream(mx.cpu):
        out = x.astype(mx.float32) @ w32.swapaxes(-1, -2)
        mx.eval(out)
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_dense_equals_mlx_within_bf16_rounding(bits):
    n, k = DENSE
    for gs, rows_list in DENSE_ROWS[bits].items():
        q, s, b = weights(n, k, bits, gs, seed=gs)
        w32 = dequantized(q, s, b, bits, gs)
        for rows in rows_list:
            x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
            got = quant_kernel.qmm(x, q, s, b, bits)
            mlx = on_cpu(lambda: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits))
            want = reference(x, w32)
            assert got.shape == (rows, n) and got.dtype == mx.bfloat16
            assert rel_err(got, want) < 1e-2, (gs, rows, rel_err(got, want))
            assert rel_err(got, mlx) < 1.5e-2, (gs, rows, rel_err(got, mlx))


def test_each_tiling_agrees():
    (n, k), gs, bits = TILING_SHAPE, 64, 4
    q, s, b = weights(n, k, bits, gs)
    x = mx.random.normal((TILING_ROWS, k), key=mx.random.key(3)).astype(mx.bfloat16)
    want = reference(x, dequantized(q, s, b, bits, gs))
    for cfg in tilings():
        got = quant_kernel.qmm(x, q, s, b, bits, cfg)
        assert rel_err(got, want) < 1e-2, cfg


def test_float16():
    (n, k), bits, gs = DENSE, 4, 128
    q, s, b = weights(n, k, bits, gs, dtype=mx.float16)
    x = mx.random.normal((8, k), key=mx.random.key(5)).astype(mx.float16)
    got = quant_kernel.qmm(x, q, s, b, bits)
    assert got.dtype == mx.float16
    assert rel_err(got, reference(x, dequantized(q, s, b, bits, gs))) < 5e-3


def test_a_rows_result_does_not_depend_on_its_batch():
    (n, k), bits, gs = DENSE, 4, 64
    q, s, b = weights(n, k, bits, gs)
    x = mx.random.normal((48, k), key=mx.random.key(9)).astype(mx.bfloat16)
    together = quant_kernel.qmm(x, q, s, b, bits)
    for i in (0, 17, 47):
        alone = quant_kernel.qmm(x[i : i + 1], q, s, b, bits)
        pair = quant_kernel.qmm(x[i : i + 2] if i < 47 else x[i - 1 : i + 1], q, s, b, bits)
        assert mx.array_equal(alone[0], together[i]).item()
        assert mx.array_equal(pair[0 if i < 47 else 1], together[i]).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_gather_equals_mlx_gather_qmm(bits):
    experts, n, k = EXPERTS
    for gs in (32, 64, 128):
        q, s, b = weights(n, k, bits, gs, experts=experts, seed=gs)
        for tokens, top in ((2, 4), (7, 2), (32, 8), (64, 8)):
            x = mx.random.normal((tokens, k), key=mx.random.key(tokens)).astype(mx.bfloat16)
            uniform = mx.random.uniform(shape=(tokens, experts), key=mx.random.key(tokens + 1))
            flat = mx.argsort(uniform, axis=-1)[:, :top].flatten()
            order = mx.argsort(flat)
            sorted_experts, rowmap = flat[order], order // top
            got = quant_kernel.gather_qmm(
                x, q, s, b, rowmap, sorted_experts, bits, rows_per_expert=GATHER_ROWS_PER_EXPERT[bits]
            )
            want = on_cpu(
                lambda: mx.gather_qmm(
                    x[rowmap][:, None], q, s, b, rhs_indices=sorted_experts, transpose=True, group_size=gs, bits=bits
                ).squeeze(1)
            )
            assert got.shape == (tokens * top, n)
            assert rel_err(got, want) < 1.5e-2, (gs, tokens, rel_err(got, want))


def test_gather_rows_past_a_blocks_capacity():
    experts, n, k, bits, gs = 4, 256, 1024, 8, 64
    q, s, b = weights(n, k, bits, gs, experts=experts, seed=2)
    x = mx.random.normal((40, k), key=mx.random.key(1)).astype(mx.bfloat16)
    sorted_experts = mx.array([0] * 3 + [2] * 37, mx.uint32)  # 37 rows on one expert, 8 at a time
    rowmap = mx.arange(40, dtype=mx.uint32)
    got = quant_kernel.gather_qmm(x, q, s, b, rowmap, sorted_experts, bits, rows_per_expert=8)
    w32 = dequantized(q, s, b, bits, gs)
    want = mx.concatenate([reference(x[:3], w32[0]), reference(x[3:], w32[2])])
    assert rel_err(got, want) < 1e-2


def test_linear_routing_takes_the_kernel_for_a_batch_only(monkeypatch):
    lin = nn.QuantizedLinear(DENSE[1], DENSE[0], bias=True, group_size=64, bits=4)
    lin.bias = mx.random.normal((DENSE[0],)).astype(mx.bfloat16)
    lin.scales, lin.biases = lin.scales.astype(mx.bfloat16), lin.biases.astype(mx.bfloat16)
    model = nn.Sequential(lin)
    assert route(model, tune=False) == 1 and type(lin) is KernelQuantizedLinear
    calls = []
    real = quant_kernel.qmm
    monkeypatch.setattr(quant_kernel, "qmm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    dims = DENSE[1]
    batch = mx.random.normal((8, 1, dims)).astype(mx.bfloat16)
    got = lin(batch)
    want = on_cpu(lambda: mx.quantized_matmul(batch, lin.weight, lin.scales, lin.biases, group_size=64, bits=4))
    want = want + lin.bias
    assert rel_err(got, want) < 1.5e-2 and calls == [(8, 1, dims)]
    lin(mx.random.normal((1, 1, dims)).astype(mx.bfloat16))  # one row: MLX's
    lin(mx.random.normal((1, 12, dims)).astype(mx.bfloat16))  # a solo prefill: MLX's
    lin(mx.random.normal((2, 12, dims)).astype(mx.bfloat16))  # a group prefill of 24 rows: ours
    assert calls == [(8, 1, dims), (2, 12, dims)]


def test_switch_glu_on_the_kernel_equals_mlx():
    dims, hidden, experts, top = GLU
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
        want = on_cpu(lambda: glu(x, idx))
    finally:
        quant_kernel.ENABLED = True
    assert rel_err(got, want) < 2e-2

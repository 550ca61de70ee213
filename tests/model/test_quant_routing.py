"""Which quantized products take the CUDA kernel (model/quant_linear.py), checked on the CPU with the
kernel stood in for by MLX's own op: the start-up line names every weight shape with the row
counts that take the kernel and why the others keep MLX's op, and the compiled decode step
(model/engine/compiled_decode.py) traces a batch's products through the kernel, one row's and a
solo prefill's through MLX's op. The kernels themselves: test_quant_kernel.py (CUDA only)."""

from __future__ import annotations

import logging
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import pytest

from model import quant_kernel, quant_linear, quant_tune
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens


@pytest.fixture
def fake_cuda(monkeypatch):
    """`available()` true, no measurement, and a `qmm` that counts its calls by row count and
    answers with MLX's op (every verdict then says: the kernel, from 2 rows)."""
    calls: Counter[int] = Counter()

    def qmm(x, w, scales, biases, bits, cfg=None):
        calls[quant_kernel.rows_of(x)] += 1
        gs = x.shape[-1] // scales.shape[-1]
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=gs, bits=bits)

    monkeypatch.setattr(quant_kernel, "available", lambda: True)
    monkeypatch.setattr(quant_kernel, "qmm", qmm)
    monkeypatch.setattr(quant_tune, "tune", lambda shapes, *a, **k: {})
    monkeypatch.setattr(quant_tune, "tune_gather", lambda shapes, *a, **k: {})
    monkeypatch.setattr(quant_kernel, "_verdicts", {})
    return calls


def quantized(inputs: int, outputs: int, **kw) -> nn.Module:
    lin = nn.QuantizedLinear(inputs, outputs, bias=False, **kw)
    for name in ("scales", "biases"):
        if name in lin:
            lin[name] = lin[name].astype(mx.bfloat16)
    return lin


def test_the_start_up_line_names_each_shape_and_each_refusal(fake_cuda, monkeypatch, caplog):
    model = nn.Sequential(
        quantized(512, 256, group_size=64, bits=4),
        quantized(256, 512, group_size=64, bits=4),
        quantized(512, 256, group_size=64, bits=4),  # the first's shape again: one entry
        quantized(512, 256, group_size=64, bits=3),
        quantized(512, 256, group_size=32, bits=4, mode="mxfp4"),
        quantized(512, 100, group_size=64, bits=4),  # 100 columns: no tiling
    )
    quant_kernel._verdicts[(256, 512, 4, 64, str(mx.bfloat16))] = [(2, False), (8, False), (16, True), (64, True)]
    quant_kernel._verdicts[(512, 256, 4, 64, str(mx.bfloat16))] = [(64, False)]
    with caplog.at_level(logging.INFO, logger="model.quant_linear"):
        assert quant_linear.route(model) == 6
    [line] = [r.getMessage() for r in caplog.records if "quantized products" in r.getMessage()]
    assert "256x512 q4 g64 bf16: kernel at rows 9-64" in line
    assert "512x256 q4 g64 bf16: MLX at every row count" in line
    assert "256x512: 3-bit: MLX (1 module)" in line
    assert "256x512: mxfp4 mode: MLX (1 module)" in line
    assert "100x512: no tiling: MLX (1 module)" in line
    assert "one row (a B=1 decode step) and a solo prefill always take MLX's op" in line


def test_a_failed_check_is_a_warning_with_its_reason(fake_cuda, monkeypatch, caplog):
    model = nn.Sequential(quantized(512, 256, group_size=64, bits=4))

    def failing(shapes, *a, **k):
        for n, k_, bits, gs, dtype in shapes:
            quant_kernel._verdicts[(n, k_, bits, gs, str(dtype))] = [(64, False)]
        failed = {"failed": "RuntimeError('differs by 0.5')"}
        return {f"{n}x{k_} q{bits} g{gs} {dtype}": failed for n, k_, bits, gs, dtype in shapes}

    monkeypatch.setattr(quant_tune, "tune", failing)
    with caplog.at_level(logging.INFO, logger="model.quant_linear"):
        quant_linear.route(model)
    [record] = [r for r in caplog.records if "quantized products" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "256x512 q4 g64 bf16: MLX (kernel failed: RuntimeError('differs by 0.5'))" in record.getMessage()


def test_activations_of_another_dtype_keep_mlx(fake_cuda, caplog):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = quantized(512, 256, group_size=64, bits=4)

        def activation_dtype(self) -> mx.Dtype:
            return mx.float32

    with caplog.at_level(logging.INFO, logger="model.quant_linear"):
        quant_linear.route(Model())
    [line] = [r.getMessage() for r in caplog.records if "quantized products" in r.getMessage()]
    assert "256x512 q4 g64 bf16: MLX at every row count [activations are f32]" in line


def test_row_ranges():
    assert quant_linear._row_ranges([2, 3, 4, 9, 10, 64]) == "2-4, 9-10, 64"
    assert quant_linear._row_ranges([]) == "none"


def test_the_compiled_decode_step_traces_a_batch_through_the_kernel(fake_cuda, tiny_model_factory):
    # 256-wide projections tile (K a multiple of 128); bf16 scales, as the kernel takes
    path = tiny_model_factory(
        "llama", dtype="bfloat16", quant="q4", hidden_size=256, intermediate_size=512, num_attention_heads=4
    )
    model = load_model(path).model
    assert any(type(m) is quant_linear.KernelQuantizedLinear for _, m in model.named_modules())
    engine = Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=16))
    assert engine._compiled is not None
    solo = generate_tokens(engine, [RowSpec(1, tuple(range(10, 30)), SamplingParams(), 4)])
    assert not fake_cuda, "one row (its prefill and its decode steps) must keep MLX's op"
    specs = [RowSpec(i, tuple(range(10, 30)), SamplingParams(), 4) for i in (2, 3, 4)]
    together = generate_tokens(engine, specs)
    # (traced once per batch size: the compiled step replays the kernel's graph afterwards)
    assert fake_cuda[3] > 0, dict(fake_cuda)
    assert all(tokens == solo[1] for tokens in together.values())


def test_the_cuda_tests_guard_fails_a_kernel_that_failed_its_smoke_run(monkeypatch):
    """tests/helpers/cuda_smoke.py: what the CUDA-only kernel tests run behind."""
    from types import SimpleNamespace

    from tests.helpers import cuda_smoke

    built = []
    module = SimpleNamespace(_kernel=lambda *key: built.append(key) or "kernel")
    good = cuda_smoke.kvq_spec(mx.bfloat16, 4, 4)
    bad = cuda_smoke.kvq_spec(mx.bfloat16, 8, 8)
    outcomes = {good: cuda_smoke.Outcome(True, 1.5), bad: cuda_smoke.Outcome(False, 60.0, "no result in 60 s")}

    def spec_of(kind, dtype, bits, group):
        return None if kind == "combine" else cuda_smoke.kvq_spec(dtype, bits, group)

    cuda_smoke.guard(monkeypatch, module, spec_of, outcomes)
    assert module._kernel("attend", mx.bfloat16, 4, 4) == "kernel"
    assert module._kernel("combine", mx.bfloat16, 8, 8) == "kernel"  # (no spec of its own)
    with pytest.raises(pytest.fail.Exception, match="kvq_attend_bf16_b8_r8_c256 failed its smoke run: no result"):
        module._kernel("attend", mx.bfloat16, 8, 8)
    with pytest.raises(pytest.fail.Exception, match="not in this module's plan"):
        module._kernel("attend", mx.bfloat16, 4, 16)
    assert built == [("attend", mx.bfloat16, 4, 4), ("combine", mx.bfloat16, 8, 8)]


def spy_on_mlx_s_op(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes MLX's `quantized_matmul` is called with from now on."""
    shapes: list[tuple[int, ...]] = []
    real = mx.quantized_matmul

    def spy(x, *a, **k):
        shapes.append(tuple(x.shape))
        return real(x, *a, **k)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return shapes


@pytest.mark.parametrize("bias", [False, True])
def test_mlx_s_op_gets_a_batch_of_rows_as_one_matrix(monkeypatch, bias):
    """Where MLX's op runs, a decode step's [B, 1, K] reaches it as one [B, K] matrix (MLX's CUDA
    op reads the weights once per leading batch entry otherwise), with the same values."""
    lin = nn.QuantizedLinear(128, 64, bias=bias, group_size=64, bits=4)
    x = mx.random.normal((5, 1, 128), key=mx.random.key(1))
    want = lin(x)
    shapes = spy_on_mlx_s_op(monkeypatch)
    lin.__class__ = quant_linear.KernelQuantizedLinear
    got = lin(x)  # (no CUDA here: `product` declines, MLX's op runs)
    assert shapes == [(5, 128)]
    assert got.shape == (5, 1, 64) and mx.array_equal(got, want)
    embed = nn.QuantizedEmbedding(64, 128, group_size=64, bits=4)
    want_head = embed.as_linear(x)
    embed.__class__ = quant_linear.KernelQuantizedEmbedding
    assert mx.array_equal(embed.as_linear(x), want_head) and shapes[-1] == (5, 128)


def test_tune_measures_row_counts_upwards_until_mlx_s_op_wins(monkeypatch):
    """Each row count past the first loss would build another kernel at load for nothing: the
    measurement stops there, and that count and larger ones keep MLX's op."""
    calls: list[tuple[str, int]] = []
    times = {2: (1.0, 2.0), 8: (3.0, 2.0), 16: (1.0, 2.0)}  # ours wins at 2, loses at 8, "would" win at 16

    def fake_time(fn, reps=20, queue=20):
        rows = fake_time.rows  # type: ignore[attr-defined]
        side = "ours" if len([c for c in calls if c[1] == rows]) % 2 == 0 else "mlx"
        calls.append((side, rows))
        return times[rows][0 if side == "ours" else 1]

    real_normal = mx.random.normal

    def normal(shape, *a, **k):
        if len(shape) == 2 and shape[0] in times:
            fake_time.rows = shape[0]  # type: ignore[attr-defined]
        return real_normal(shape, *a, **k)

    monkeypatch.setattr(quant_tune, "_time", fake_time)
    monkeypatch.setattr(quant_tune.mx.random, "normal", normal)
    monkeypatch.setattr(
        quant_kernel,
        "qmm",
        lambda x, w, s, b, bits, cfg=None: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits),
    )
    monkeypatch.setattr(quant_kernel, "_verdicts", {})
    report = quant_tune.tune([(256, 512, 4, 64, mx.bfloat16)], rows=(2, 8, 16))
    key = (256, 512, 4, 64, str(mx.bfloat16))
    assert quant_kernel._verdicts[key] == [(2, True), (8, False)]
    assert sorted({rows for _, rows in calls}) == [2, 8]  # 16 never timed
    assert [quant_kernel.wins(256, 512, 4, 64, mx.bfloat16, r) for r in (2, 5, 8, 16, 64)] == [
        True, False, False, False, False,
    ]  # fmt: skip
    assert next(iter(report.values()))["kernel_rows"] == [2]


def test_tensor_parallel_keeps_mlx_s_op_with_rows_as_one_matrix(fake_cuda, monkeypatch):
    """After a split (`rows_only`), sharded and replicated quantized linears alike give MLX's op a
    decode step's rows as one matrix, never the kernel (the ranks must round the replicated LM
    head alike), with the values of MLX's own classes."""
    from mlx.nn.layers.distributed import shard_linear

    group = mx.distributed.init()  # a group of one: the classes of a split, without a ring
    x = mx.random.normal((3, 1, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    embed = nn.QuantizedEmbedding(64, 128, group_size=64, bits=4)
    model = nn.Sequential(
        shard_linear(quantized(128, 64, group_size=64, bits=4), "all-to-sharded", group=group),
        shard_linear(quantized(128, 64, group_size=64, bits=4), "sharded-to-all", group=group),
        quantized(128, 64, group_size=64, bits=4),
    )
    quant_linear.route(model)  # at load, before the split: the replicated one takes the kernel
    model.layers[2](x)
    assert fake_cuda[3] == 1
    model.layers[2].__class__ = nn.QuantizedLinear
    wants = [layer(x) for layer in model.layers] + [embed.as_linear(x)]
    shapes = spy_on_mlx_s_op(monkeypatch)
    model.layers[2].__class__ = quant_linear.KernelQuantizedLinear
    embed.__class__ = quant_linear.KernelQuantizedEmbedding
    assert quant_linear.rows_only(model) == 3 and quant_linear.rows_only(embed) == 1
    gots = [layer(x) for layer in model.layers] + [embed.as_linear(x)]
    assert fake_cuda[3] == 1  # no further kernel call
    assert shapes == [(3, 128)] * 4
    for got, want in zip(gots, wants, strict=True):
        assert got.shape == want.shape and mx.array_equal(got, want)
    monkeypatch.setattr(quant_kernel, "available", lambda: False)
    assert quant_linear.rows_only(nn.Sequential(quantized(128, 64, group_size=64, bits=4))) == 0

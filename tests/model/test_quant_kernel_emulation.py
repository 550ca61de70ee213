"""The quantized-matmul kernel's index arithmetic on the CPU (tests/model/qmm_emulator.py runs the
kernel's data movement lane by lane): for every bit width, group size and tiling, dense and
routed, its output equals the dequantized product up to float32 summation order and one
rounding. The kernel itself runs in test_quant_kernel.py, on a CUDA GPU only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.quant_kernel import Config
from tests.model.qmm_emulator import bf16, emulate


def quantized(n: int, k: int, bits: int, gs: int, experts: int = 0, seed: int = 0):  # type: ignore[no-untyped-def]
    shape = (experts, n, k) if experts else (n, k)
    w = (mx.random.normal(shape, key=mx.random.key(seed)) * 0.05).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    qn, sn, bn = np.array(q), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))
    # w = s * q + b rounded once to bf16, as the kernel's fma does (mx.dequantize may round twice)
    vals = np.stack([(qn >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)], -1).reshape(shape)
    groups = vals.reshape(*shape[:-1], -1, gs).astype(np.float32)
    deq = bf16((groups * sn[..., None] + bn[..., None]).reshape(shape).astype(np.float32))
    return qn, sn, bn, deq


def activations(m: int, k: int, seed: int = 1) -> np.ndarray:
    return bf16(np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32))


def close(got: np.ndarray, want: np.ndarray) -> None:
    assert not np.isnan(got).any()
    # one bf16 rounding of the float32 sum either side: within 2 ulps of the largest output
    tol = 2 * 2.0**-8 * np.abs(want).max()
    assert np.abs(got - bf16(want)).max() <= tol


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize(
    ("cfg", "rows", "maxnt"),
    [(Config(2, 1, 1), 3, 1), (Config(1, 2, 1), 13, 2), (Config(1, 1, 2), 9, 2), (Config(2, 2, 2, u=3), 20, 4)],
)
def test_dense_equals_the_dequantized_product(bits, gs, cfg, rows, maxnt):
    n = 32
    k = cfg.k_step(bits) * 2
    q, s, b, deq = quantized(n, k, bits, gs)
    x = activations(rows, k)
    got = emulate(x, q, s, b, bits, cfg, maxnt)
    close(got, x.astype(np.float64) @ deq.T.astype(np.float64))


def test_rows_past_the_capacity_loop_over_chunks():
    bits, gs, cfg = 4, 64, Config(1, 1, 1)
    q, s, b, deq = quantized(16, 256, bits, gs)
    x = activations(11, 256)
    got = emulate(x, q, s, b, bits, cfg, maxnt=1)  # 8 rows at a time
    close(got, x.astype(np.float64) @ deq.T.astype(np.float64))


@pytest.mark.parametrize("bits", [4, 8])
def test_gather_rows_meet_their_own_experts(bits):
    gs, cfg, e = 64, Config(1, 2, 1), 4
    k = cfg.k_step(bits)
    q, s, b, deq = quantized(16, k, bits, gs, experts=e)
    x = activations(5, k)
    experts = np.array([0, 0, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], np.uint32)  # expert 1 unused; 10 rows on 3
    rowmap = np.array([4, 1, 0, 2, 4, 3, 1, 0, 2, 4, 3, 3, 1, 0, 2], np.uint32)
    got = emulate(x, q, s, b, bits, cfg, maxnt=1, experts=experts, rowmap=rowmap)
    want = np.stack([x[r].astype(np.float64) @ deq[ex].T.astype(np.float64) for r, ex in zip(rowmap, experts)])
    close(got, want)


def test_a_rows_result_does_not_depend_on_its_batch():
    bits, gs, cfg = 4, 32, Config(1, 2, 2)
    k = cfg.k_step(bits)
    q, s, b, _ = quantized(16, k, bits, gs)
    x = activations(12, k)
    together = emulate(x, q, s, b, bits, cfg, maxnt=2)
    for i in (0, 7, 11):
        alone = emulate(x[i : i + 1], q, s, b, bits, cfg, maxnt=1)
        assert np.array_equal(alone[0], together[i])


@pytest.mark.parametrize(("bits", "gs", "group", "lp"), [(4, 64, 4, [0, 5]), (8, 32, 2, [3, 0]), (4, 128, 9, [0, 0])])
def test_decode_attention_equals_softmax_over_dequantized_kv(bits, gs, group, lp):
    from tests.model.kvq_emulator import emulate as attend

    B, hkv, T, D = 2, 2, 45, 128
    rng = np.random.default_rng(bits + gs)
    q = bf16(rng.standard_normal((B, hkv * group, 1, D)).astype(np.float32))
    triples, deq = [], []
    for seed in (1, 2):
        x = (mx.random.normal((B, hkv, T, D), key=mx.random.key(seed))).astype(mx.bfloat16)
        packed, s, b = mx.quantize(x, group_size=gs, bits=bits)
        qn, sn, bn = np.array(packed), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))
        vals = np.stack([(qn >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)], -1).reshape(B, hkv, T, D)
        full = vals.reshape(B, hkv, T, -1, gs).astype(np.float32) * sn[..., None] + bn[..., None]
        triples.append((qn, sn, bn))
        deq.append(bf16(full.reshape(B, hkv, T, D).astype(np.float32)))
    scale = D**-0.5
    got = attend(q, triples[0], triples[1], scale, np.array(lp), bits, chunk=32)
    want = np.zeros_like(got)
    for b_ in range(B):
        for hq in range(hkv * group):
            k, v = deq[0][b_, hq // group, lp[b_] :], deq[1][b_, hq // group, lp[b_] :]
            s_ = scale * (k.astype(np.float64) @ q[b_, hq, 0].astype(np.float64))
            p = np.exp(s_ - s_.max())
            want[b_, hq, 0] = (p / p.sum()) @ v
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()

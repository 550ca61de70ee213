"""Decode attention over a quantized KV cache on CUDA (model/kv/quant_kernel.py), on a CUDA GPU
only: it equals softmax attention over the dequantized keys and values within bf16 rounding for
4/8 bits, every group size, GQA groups of 4, 8 and 16 heads per KV head, caches that are views of
larger buffers, left padding and several chunks; a row's output does not depend on its batch or
its padding; the quantized caches take it for a decode step. The index arithmetic is also
checked on the CPU (test_quant_kernel_emulation.py).

Each (bits, heads per KV head) is an NVRTC compile of the attend kernel (the combine is one per
dtype); the group size is read at run time, so every case sweeps all three. `CASES` makes 3
attend kernels and 1 combine, smoke-run in child processes first (tests/helpers/cuda_smoke.py)."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from model.kv import quant_kernel as kv_quant_kernel
from model.kv.quant import QuantizedBatchKVCache, QuantizedKVCache, quantized_attention
from model.kv.scheme import LayerQuant
from tests.helpers import cuda_smoke

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels: needs an NVIDIA GPU")

# (bits, heads per KV head, cache length, buffer capacity): a few positions; several chunks of a
# view into a larger buffer (Qwen3-30B-A3B's 8 heads per KV head); the largest group; 12 chunks.
CASES = [(4, 4, 37, 0), (8, 8, 700, 1024), (4, 16, 257, 0), (4, 4, 3000, 3072)]
CACHE_HEADS = (32, 4)  # test_quantized_caches_attend_with_the_kernel: 8-bit, 8 heads per KV head


def plan() -> set[cuda_smoke.Spec]:
    return {cuda_smoke.kvq_spec(mx.bfloat16, bits, group) for bits, group, _, _ in CASES}


@pytest.fixture(scope="module")
def smoked(request: pytest.FixtureRequest) -> dict[cuda_smoke.Spec, cuda_smoke.Outcome]:
    start = time.perf_counter()
    outcomes = cuda_smoke.run(plan())
    cuda_smoke.report(request.config, "test_kv_quant_kernel.py", outcomes, time.perf_counter() - start)
    return outcomes


@pytest.fixture(autouse=True)
def guarded(smoked: dict[cuda_smoke.Spec, cuda_smoke.Outcome], monkeypatch: pytest.MonkeyPatch) -> None:
    def spec_of(kind: str, dtype: mx.Dtype, bits: int, group: int) -> cuda_smoke.Spec | None:
        return None if kind == "combine" else cuda_smoke.kvq_spec(dtype, bits, group)

    cuda_smoke.guard(monkeypatch, kv_quant_kernel, spec_of, smoked)


def rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


def quantized_kv(B: int, hkv: int, T: int, bits: int, gs: int, capacity: int = 0, seed: int = 0):  # type: ignore[no-untyped-def]
    cap = max(capacity, T)
    out = []
    for s in (seed, seed + 1):
        x = mx.random.normal((B, hkv, cap, 128), key=mx.random.key(s)).astype(mx.bfloat16)
        q, sc, bi = mx.quantize(x, group_size=gs, bits=bits)
        out.append(tuple(a[..., :T, :] for a in (q, sc, bi)))  # views when capacity > T
    return out


def reference(q, k, v, scale, lp, bits, gs):  # type: ignore[no-untyped-def]
    """float32 softmax attention over the dequantized K/V, each row from its left padding (CPU)."""
    B, HQ, _, D = q.shape
    hkv = k[0].shape[1]
    rows = []
    with mx.stream(mx.cpu):
        kd = mx.dequantize(*k, group_size=gs, bits=bits).astype(mx.float32)
        vd = mx.dequantize(*v, group_size=gs, bits=bits).astype(mx.float32)
        for b in range(B):
            kk = mx.repeat(kd[b : b + 1, :, lp[b] :], HQ // hkv, axis=1)
            vv = mx.repeat(vd[b : b + 1, :, lp[b] :], HQ // hkv, axis=1)
            s = (q[b : b + 1].astype(mx.float32) * scale) @ kk.swapaxes(-1, -2)
            rows.append(mx.softmax(s, axis=-1) @ vv)
        out = mx.concatenate(rows)
        mx.eval(out)
    return out


@pytest.mark.parametrize(("bits", "group", "T", "cap"), CASES)
def test_equals_softmax_over_the_dequantized_cache(bits, group, T, cap):
    B, hkv = 3, 2
    for gs in (32, 64, 128):
        k, v = quantized_kv(B, hkv, T, bits, gs, cap, seed=T + gs)
        q = mx.random.normal((B, hkv * group, 1, 128), key=mx.random.key(7)).astype(mx.bfloat16)
        lp = [0, min(5, T - 1), T // 2]
        assert kv_quant_kernel.usable(q, k, bits, gs)
        got = kv_quant_kernel.decode_attention(q, k, v, 128**-0.5, mx.array(lp), bits)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert rel_err(got, reference(q, k, v, 128**-0.5, lp, bits, gs)) < 1e-2, gs


def test_a_rows_output_does_not_depend_on_its_batch_or_padding():
    bits, gs, T = 4, 64, 1000
    k, v = quantized_kv(4, 8, T, bits, gs, seed=3)
    q = mx.random.normal((4, 32, 1, 128)).astype(mx.bfloat16)
    lp = mx.array([0, 40, 300, 999])
    together = kv_quant_kernel.decode_attention(q, k, v, 0.1, lp, bits)
    for i in (1, 2):
        start = int(lp[i].item())
        alone = kv_quant_kernel.decode_attention(
            q[i : i + 1],
            tuple(a[i : i + 1, :, start:] for a in k),
            tuple(a[i : i + 1, :, start:] for a in v),
            0.1,
            None,
            bits,
        )
        assert mx.array_equal(alone[0], together[i]).item()


def test_quantized_caches_attend_with_the_kernel(monkeypatch):
    quant = LayerQuant(bits=8, group_size=64)
    solo, batch = QuantizedKVCache(quant), None
    hq, hkv = CACHE_HEADS
    keys = mx.random.normal((1, hkv, 300, 128)).astype(mx.bfloat16)
    values = mx.random.normal((1, hkv, 300, 128)).astype(mx.bfloat16)
    solo.update_and_fetch(keys, values)
    batch = QuantizedBatchKVCache.merge(quant, [solo.clone(), solo.clone()])
    calls = []
    monkeypatch.setitem(kv_quant_kernel._verified, (mx.bfloat16, 8, 64, hq // hkv), True)  # (no self-check call)
    real = kv_quant_kernel.decode_attention
    monkeypatch.setattr(kv_quant_kernel, "decode_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    q = mx.random.normal((1, hq, 1, 128)).astype(mx.bfloat16)
    k1, v1 = (mx.random.normal((1, hkv, 1, 128)).astype(mx.bfloat16) for _ in range(2))
    got = solo.attend(q, k1, v1, 0.088, None, None)  # type: ignore[arg-type]
    qk = (solo.keys[0][..., :301, :], solo.keys[1][..., :301, :], solo.keys[2][..., :301, :])  # type: ignore[index]
    qv = (solo.values[0][..., :301, :], solo.values[1][..., :301, :], solo.values[2][..., :301, :])  # type: ignore[index]
    with monkeypatch.context() as m:
        m.setattr(kv_quant_kernel, "usable", lambda *a: False)
        want = quantized_attention(q, qk, qv, 0.088, None, quant)
    assert rel_err(got, want) < 1e-2
    both = batch.attend(mx.concatenate([q, q]), mx.concatenate([k1, k1]), mx.concatenate([v1, v1]), 0.088, None, None)  # type: ignore[arg-type]
    assert calls == [(1, hq, 1, 128), (2, hq, 1, 128)]
    assert mx.array_equal(both[0], got[0]).item() and mx.array_equal(both[1], got[0]).item()

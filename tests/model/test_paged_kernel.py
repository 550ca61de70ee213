"""Decode attention over the paged KV pool on CUDA (model/kv/paged_kernel.py), on a CUDA GPU only:
it equals attention over each row's gathered positions within bf16/f16 rounding for head dims 64
and 128, GQA groups of 4, 8 and 16 heads per KV head, rows of one position, rows ending on a block
end and rows spanning several blocks stored out of order; a row's output does not depend on its
batch; its first-use check passes; the paged cache takes it for a decode step and gathers for
anything else. The index arithmetic is also checked on the CPU (test_paged_kernel_emulation.py).

Each (dtype, head dim, heads per KV head) is an NVRTC compile of the attend kernel (the combine is
one per dtype); `CASES` makes 4 attend kernels and 2 combines, smoke-run in child processes first
(tests/helpers/cuda_smoke.py)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from model.kv import paged_kernel
from model.kv.cache import KVCache
from model.kv.paged import BLOCK, PagedBatchKVCache
from tests.helpers import cuda_smoke

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA kernels: needs an NVIDIA GPU")

# (dtype, head dim, heads per KV head, row lengths)
CASES = [
    (mx.bfloat16, 128, 4, [1, 700, 256]),
    (mx.bfloat16, 128, 8, [3000, 37]),  # 12 blocks (Qwen3-30B-A3B's 8 heads per KV head)
    (mx.bfloat16, 64, 16, [257, 513]),
    (mx.float16, 128, 4, [300, 5]),
]


def plan() -> set[cuda_smoke.Spec]:
    return {cuda_smoke.kvp_spec(dtype, head_dim, group) for dtype, head_dim, group, _ in CASES}


@pytest.fixture(scope="module")
def smoked(request: pytest.FixtureRequest) -> dict[cuda_smoke.Spec, cuda_smoke.Outcome]:
    start = time.perf_counter()
    outcomes = cuda_smoke.run(plan())
    cuda_smoke.report(request.config, "test_paged_kernel.py", outcomes, time.perf_counter() - start)
    return outcomes


@pytest.fixture(autouse=True)
def guarded(smoked: dict[cuda_smoke.Spec, cuda_smoke.Outcome], monkeypatch: pytest.MonkeyPatch) -> None:
    def spec_of(kind: str, dtype: mx.Dtype, head_dim: int, group: int) -> cuda_smoke.Spec | None:
        return None if kind == "combine" else cuda_smoke.kvp_spec(dtype, head_dim, group)

    cuda_smoke.guard(monkeypatch, paged_kernel, spec_of, smoked)


def rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()  # type: ignore[return-value]


def pool(dtype: mx.Dtype, head_dim: int, lengths: list[int], hkv: int = 2, seed: int = 0):  # type: ignore[no-untyped-def]
    """Pools holding the rows' blocks in a shuffled order (and one block no row uses), the tables."""
    counts = [-(-n // BLOCK) for n in lengths]
    blocks = 1 + sum(counts)
    order = np.random.default_rng(seed).permutation(blocks).tolist()
    tables, start = [], 0
    for n in counts:
        tables.append(order[start : start + n])
        start += n
    kp, vp = (
        mx.random.normal((blocks, hkv, BLOCK, head_dim), key=mx.random.key(seed + i)).astype(dtype) for i in (1, 2)
    )
    table = np.zeros((len(lengths), max(counts)), np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    return kp, vp, tables, mx.array(table)


def reference(q, kp, vp, tables, lengths, scale):  # type: ignore[no-untyped-def]
    """float32 attention over each row's gathered positions, on the CPU."""
    with mx.stream(mx.cpu):
        f32 = [a.astype(mx.float32) for a in (q, kp, vp)]
        out = paged_kernel.gathered_attention(*f32, tables, lengths, scale)
        mx.eval(out)
    return out


@pytest.mark.parametrize(("dtype", "head_dim", "group", "lengths"), CASES)
def test_equals_attention_over_the_gathered_rows(dtype, head_dim, group, lengths):
    kp, vp, tables, table = pool(dtype, head_dim, lengths, seed=head_dim + group)
    q = mx.random.normal((len(lengths), 2 * group, 1, head_dim), key=mx.random.key(7)).astype(dtype)
    assert paged_kernel.usable(q, kp, vp)
    got = paged_kernel.decode_attention(q, kp, vp, table, mx.array(lengths, mx.int32), head_dim**-0.5)
    assert got.shape == q.shape and got.dtype == dtype
    assert rel_err(got, reference(q, kp, vp, tables, lengths, head_dim**-0.5)) < 1e-2


def test_a_rows_output_does_not_depend_on_its_batch():
    lengths = [3000, 40, 700]
    kp, vp, tables, table = pool(mx.bfloat16, 128, lengths, hkv=8, seed=3)
    q = mx.random.normal((3, 32, 1, 128)).astype(mx.bfloat16)
    together = paged_kernel.decode_attention(q, kp, vp, table, mx.array(lengths, mx.int32), 0.1)
    for i in (1, 2):
        alone_table = mx.array([tables[i]], mx.int32)
        alone = paged_kernel.decode_attention(q[i : i + 1], kp, vp, alone_table, mx.array([lengths[i]], mx.int32), 0.1)
        assert mx.array_equal(alone[0], together[i]).item()


def test_the_first_use_check_passes_and_odd_shapes_are_refused(monkeypatch):
    monkeypatch.setattr(paged_kernel, "_verified", {})
    kp, vp, _, _ = pool(mx.bfloat16, 128, [10], hkv=2)
    q = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    assert paged_kernel.usable(q, kp, vp) and paged_kernel._verified == {(mx.bfloat16, 128, 4): True}
    assert not paged_kernel.usable(mx.zeros((1, 8, 2, 128), mx.bfloat16), kp, vp)  # a verification's 2 positions
    assert not paged_kernel.usable(q.astype(mx.float32), kp, vp)  # float32 activations
    assert not paged_kernel.usable(mx.zeros((1, 64, 1, 128), mx.bfloat16), kp, vp)  # 32 heads per KV head
    odd = mx.zeros((2, 2, BLOCK, 96), mx.bfloat16)
    assert not paged_kernel.usable(mx.zeros((1, 8, 1, 96), mx.bfloat16), odd, odd)  # head dim 96


def test_the_paged_cache_decodes_with_the_kernel_and_gathers_otherwise(monkeypatch):
    rows = []
    for n in (300, 20):
        c = KVCache()
        c.update_and_fetch(*(mx.random.normal((1, 2, n, 128)).astype(mx.bfloat16) for _ in range(2)))
        rows.append(c)
    kernel, gathered = PagedBatchKVCache.merge(rows), PagedBatchKVCache.merge([r.clone() for r in rows])
    calls = []
    real = paged_kernel.decode_attention
    monkeypatch.setattr(paged_kernel, "decode_attention", lambda *a: calls.append(a[0].shape) or real(*a))

    def sdpa(q, k, v, mask):  # type: ignore[no-untyped-def]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)

    q = mx.random.normal((2, 8, 1, 128)).astype(mx.bfloat16)
    k1, v1 = (mx.random.normal((2, 2, 1, 128)).astype(mx.bfloat16) for _ in range(2))
    got = kernel.attend(q, k1, v1, 0.088, None, sdpa)
    assert calls == [(2, 8, 1, 128)]
    with monkeypatch.context() as m:
        m.setattr(paged_kernel, "usable", lambda *a: False)
        want = gathered.attend(q, k1, v1, 0.088, None, sdpa)
    assert rel_err(got, want) < 1e-2
    # Two positions a row (a verification): the gathered rows, not the kernel.
    q2, k2, v2 = (mx.random.normal((2, h, 2, 128)).astype(mx.bfloat16) for h in (8, 2, 2))
    kernel.attend(q2, k2, v2, 0.088, None, sdpa)
    assert len(calls) == 1 and kernel.lengths == [303, 23]

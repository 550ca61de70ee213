"""The paged batch kind (model/kv/paged.py) against the contiguous one it stands in for: the same
attention outputs bit for bit through merges, decode steps across block ends, rows joining and
leaving, and drafts taken back; rows come out as the solo caches they went in as; the pool hands
a leaving row's blocks to the next row, holds a long row in many blocks, takes blocks back on a
trim, and bills (and keeps) only what its rows hold. Which layers page is the scheme's
(model/kv/rows.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from model.kv.cache import BatchKVCache, KVCache
from model.kv.paged import BLOCK, PagedBatchKVCache
from model.kv.rotating import BatchRotatingKVCache, RotatingKVCache
from model.kv.rows import is_merged, merge_batch
from model.kv.scheme import KVScheme, LayerQuant
from model.kv.state import BatchStateCache, StateCache

H, D, HQ = 2, 8, 4
SCALE = D**-0.5


def kv(n: int, seed: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((rows, H, n, D)).astype(np.float32)) for _ in range(2))  # type: ignore[return-value]


def solo(n: int, seed: int) -> KVCache:
    c = KVCache()
    if n:
        c.update_and_fetch(*kv(n, seed))
    return c


def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: object) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)


def step(caches: list, n: int, seed: int) -> list[np.ndarray]:
    """One forward of `n` positions per row through each cache (the same inputs): the outputs."""
    rows = caches[0].size
    k, v = kv(n, seed, rows)
    q = mx.array(np.random.default_rng(seed + 1).standard_normal((rows, HQ, n, D)).astype(np.float32))
    outs = []
    for c in caches:
        mask = c.make_mask(n)
        outs.append(np.array(c.attend(q, k, v, SCALE, mask, sdpa)))
    return outs


def same_rows(paged: PagedBatchKVCache, batch: BatchKVCache) -> None:
    assert paged.lengths == [int(x) for x in np.array(batch.offset)]
    assert np.array_equal(np.array(paged.offset), np.array(batch.offset))
    for i in range(paged.size):
        a, b = paged.extract(i), batch.extract(i)
        assert a.offset == b.offset
        if a.offset:
            assert np.array_equal(np.array(a.keys), np.array(b.keys))
            assert np.array_equal(np.array(a.values), np.array(b.values))


def pair(lengths: list[int], seed: int = 0) -> tuple[PagedBatchKVCache, BatchKVCache]:
    rows = [solo(n, seed + i) for i, n in enumerate(lengths)]
    return PagedBatchKVCache.merge(rows), BatchKVCache.merge(rows)


def test_attention_equals_the_contiguous_batch_bit_for_bit_through_a_rows_life():
    paged, batch = pair([300, 5, 0, 255])
    assert paged.held_blocks == 2 + 1 + 0 + 1
    for s in range(3):  # across row 3's block end (255 -> 258) and into row 2's first block
        a, b = step([paged, batch], 1, 10 + s)
        assert np.array_equal(a, b)
    same_rows(paged, batch)
    # Two rows join (one long: several blocks), one leaves, steps go on.
    joining = [solo(600, 40), solo(17, 41)]
    paged.extend(PagedBatchKVCache.merge(joining))
    batch.extend(BatchKVCache.merge(joining))
    a, b = step([paged, batch], 1, 50)
    assert np.array_equal(a, b)
    paged.filter([0, 2, 4, 5])
    batch.filter([0, 2, 4, 5])
    for s in range(2):
        a, b = step([paged, batch], 1, 60 + s)
        assert np.array_equal(a, b)
    same_rows(paged, batch)
    # A verification of 3 positions a row, drafts taken back unevenly, then decoding on.
    a, b = step([paged, batch], 3, 70)
    assert np.array_equal(a, b)
    paged.reject([3, 1, 2, 1], 3)
    batch.reject([3, 1, 2, 1], 3)
    same_rows(paged, batch)
    a, b = step([paged, batch], 1, 80)
    # (the contiguous batch masks its taken-back slots as holes; the paged rows dropped them)
    assert np.allclose(a, b, atol=1e-6)
    same_rows(paged, batch)


def test_the_check_can_fail_a_row_reading_another_rows_block_differs():
    paged, batch = pair([300, 40])
    paged.tables[1] = [paged.tables[0][0]]  # row 1 now reads row 0's first block
    a, b = step([paged, batch], 1, 3)
    assert not np.array_equal(a[0][1], b[0][1])


def test_a_leaving_rows_blocks_go_to_the_next_row():
    paged, _ = pair([600, 300, 10])  # 3 + 2 + 1 blocks
    capacity, leaving = paged.capacity, set(paged.tables[0])
    paged.filter([1, 2])
    assert set(paged.free) >= leaving and paged.held_blocks == 3
    paged.extend(PagedBatchKVCache.merge([solo(700, 5)]))  # 3 blocks: the ones row 0 left
    assert set(paged.tables[2]) == leaving and paged.capacity == capacity
    assert np.array_equal(np.array(paged.extract(2).keys), np.array(solo(700, 5).keys)[..., :700, :])


def test_a_long_row_spans_many_blocks_and_takes_one_more_at_each_end():
    paged = PagedBatchKVCache.merge([solo(5 * BLOCK - 1, 1), solo(3, 2)])
    assert [len(t) for t in paged.tables] == [5, 1]
    step([paged], 1, 3)  # row 0 fills its fifth block
    assert [len(t) for t in paged.tables] == [5, 1] and paged.lengths == [5 * BLOCK, 4]
    step([paged], 1, 4)  # and crosses into a sixth
    assert [len(t) for t in paged.tables] == [6, 1]
    assert len({b for t in paged.tables for b in t}) == 7  # no block shared


def test_a_trim_frees_the_blocks_past_a_rows_end():
    paged = PagedBatchKVCache.merge([solo(BLOCK - 2, 1), solo(10, 2)])
    step([paged], 4, 3)  # row 0: 254 -> 258, a second block
    assert [len(t) for t in paged.tables] == [2, 1]
    paged.reject([1, 4], 4)  # row 0 back to 255: its second block returns
    assert paged.lengths == [BLOCK - 1, 14] and [len(t) for t in paged.tables] == [1, 1]
    assert paged.held_blocks == 2 and len(paged.free) == paged.capacity - 2


def test_rows_leave_as_solo_caches_and_a_lone_row_decodes_on_alone():
    caches = [solo(300, 1), solo(20, 2)]
    paged = PagedBatchKVCache.merge(caches)
    row = paged.row(0, 100)
    assert row.offset == 100 and row.keys is not None and row.keys.shape[2] == 100
    assert np.array_equal(np.array(row.keys), np.array(caches[0].keys)[..., :100, :])
    paged.filter([0])
    alone = paged.to_solo()
    assert type(alone) is KVCache and alone.offset == 300
    assert alone.keys is not None and alone.keys.shape[2] % BLOCK == 0  # a capacity warm-up met
    ref = solo(300, 1)
    k, v = kv(1, 9)
    q = mx.array(np.ones((1, HQ, 1, D), np.float32))
    got = alone.attend(q, k, v, SCALE, None, sdpa)
    assert np.array_equal(np.array(got), np.array(ref.attend(q, k, v, SCALE, None, sdpa)))


def test_nbytes_bills_the_blocks_held_and_a_sparse_pool_compacts():
    paged = PagedBatchKVCache.merge([solo(2000, i) for i in range(4)] + [solo(10, 9)])
    per_block = 2 * H * BLOCK * D * 4  # keys and values, float32
    assert paged.nbytes == paged.held_blocks * per_block == (4 * 8 + 1) * per_block
    contiguous = BatchKVCache.merge([solo(2000, i) for i in range(4)] + [solo(10, 9)])
    assert contiguous.nbytes > paged.nbytes  # the short row is not padded to 2000
    kept = paged.extract(4)
    paged.filter([4])  # 32 blocks free, 1 held: the pool keeps only what is held
    assert paged.capacity == 1 and paged.free == [] and paged.nbytes == per_block
    assert np.array_equal(np.array(paged.extract(0).keys), np.array(kept.keys))


def test_rows_that_join_empty_start_at_position_zero():
    paged, batch = pair([0, 0])
    assert paged.capacity == 0 and paged.nbytes == 0
    a, b = step([paged, batch], 1, 1)
    assert np.array_equal(a, b) and paged.lengths == [1, 1]


def test_the_scheme_pages_only_full_precision_full_attention_layers():
    window, state = RotatingKVCache(16), StateCache()
    rows = [[solo(30, 1), window, state, solo(30, 2)], [solo(5, 3), RotatingKVCache(16), StateCache(), solo(5, 4)]]
    for r in rows:
        r[1].update_and_fetch(*kv(20, 5))
        r[2].update(mx.zeros((1, 3, 4)), mx.zeros((1, 2, 4, 4)), 20)
    paged = merge_batch(KVScheme(paged=True), rows)
    assert [type(c) for c in paged] == [PagedBatchKVCache, BatchRotatingKVCache, BatchStateCache, PagedBatchKVCache]
    assert is_merged(paged)
    assert type(merge_batch(KVScheme(), rows)[0]) is BatchKVCache
    # Under a quantizing scheme the quantized layers keep their kind; a full-precision one pages.
    scheme = KVScheme("config", (LayerQuant(8, 64), None, None, None), paged=True)
    mixed = merge_batch(scheme, rows)
    assert type(mixed[0]).__name__ == "MixedBatchKVCache" and type(mixed[3]) is PagedBatchKVCache


def test_the_flag_reaches_the_scheme_and_not_its_cache_key():
    from model.kv.scheme import resolve
    from model.options import KVOptions

    on = resolve(KVOptions(paged_kv=True), model_dir=None, num_layers=2)
    q8 = resolve(KVOptions(kv_quant="8", paged_kv=True), model_dir=None, num_layers=2)
    assert on.paged and q8.paged and not resolve(KVOptions(), model_dir=None, num_layers=2).paged
    plain_q8 = resolve(KVOptions(kv_quant="8"), model_dir=None, num_layers=2)
    assert on.cache_key == "" and q8.cache_key == plain_q8.cache_key


@pytest.mark.parametrize("lengths", [[1, 2], [BLOCK, BLOCK + 1, 3 * BLOCK - 1]])
def test_gathered_layout_is_the_contiguous_batchs(lengths):
    paged, batch = pair(lengths, seed=3)
    k, v = kv(1, 7, len(lengths))
    mask_p, mask_b = paged.make_mask(1), batch.make_mask(1)
    assert np.array_equal(np.array(mask_p), np.array(mask_b))
    kp, vp = paged.update_and_fetch(k, v)
    kb, vb = batch.update_and_fetch(k, v)
    assert kp.shape == kb.shape
    live = np.broadcast_to(np.array(mask_b)[:, :, -1:, :].transpose(0, 1, 3, 2), kp.shape)  # unmasked slots
    assert np.array_equal(np.array(kp)[live], np.array(kb)[live])
    assert np.array_equal(np.array(vp)[live], np.array(vb)[live])


@pytest.mark.parametrize("kernel", ["raises", "disagrees"])
def test_a_kernel_failing_its_first_use_check_is_never_used(monkeypatch, caplog, kernel):
    """(As on CUDA, where `usable` checks the kernel once against the gathered rows.)"""
    from model.kv import paged_kernel

    monkeypatch.setattr(paged_kernel.quant_kernel, "available", lambda: True)  # "a CUDA GPU"
    monkeypatch.setattr(paged_kernel, "_verified", {})
    calls = []

    def fake(q, *rest):  # type: ignore[no-untyped-def]
        calls.append(q.shape)
        if kernel == "raises":
            raise RuntimeError("cannot compile")
        return mx.zeros_like(q)

    monkeypatch.setattr(paged_kernel, "decode_attention", fake)
    rng, dim = np.random.default_rng(1), 64  # (a head dim the kernel takes)

    def rand(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float16))

    rows = [KVCache(), KVCache()]
    for n, c in zip((300, 100), rows):
        c.update_and_fetch(rand(1, H, n, dim), rand(1, H, n, dim))
    paged, batch = PagedBatchKVCache.merge(rows), BatchKVCache.merge(rows)
    for _ in range(2):
        q, k, v = rand(2, HQ, 1, dim), rand(2, H, 1, dim), rand(2, H, 1, dim)
        got = paged.attend(q, k, v, SCALE, None, sdpa)
        want = batch.attend(q, k, v, SCALE, batch.make_mask(1), sdpa)
        assert np.array_equal(np.array(got), np.array(want))  # gathered
    assert len(calls) == 1 and paged_kernel._verified == {(mx.float16, dim, HQ // H): False}  # checked once
    assert "paged-KV decode attention kernel" in caplog.text and " off" in caplog.text

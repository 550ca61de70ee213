"""model/kv/paged_kernel.py's index arithmetic, emulated lane by lane on the CPU
(tests/model/kvp_emulator.py): the decode attention it computes over a row's blocks, read
through the row's table in any order, equals softmax attention over the row's gathered positions
within bf16 rounding, for head dims 64 and 128 and GQA groups up to 16; a row's output does not
depend on the rows beside it; a wrong table is caught. (tests/model/test_paged_kernel.py runs the
kernel itself, on a CUDA GPU.)"""

from __future__ import annotations

import numpy as np
import pytest

from tests.model.kvp_emulator import BLOCK, emulate
from tests.model.qmm_emulator import bf16


def case(D: int, group: int, lengths: list[int], seed: int) -> tuple[np.ndarray, ...]:
    """Queries, pools and tables: each row's blocks scattered through the pool (shuffled), the
    pool holding one unused block (whatever it holds is never read)."""
    rng = np.random.default_rng(seed)
    hkv, counts = 2, [-(-n // BLOCK) for n in lengths]
    blocks = 1 + sum(counts)
    order = rng.permutation(blocks)
    table = np.zeros((len(lengths), max(counts)), np.int64)
    start = 0
    for i, n in enumerate(counts):
        table[i, :n] = order[start : start + n]
        start += n
    q = bf16(rng.standard_normal((len(lengths), hkv * group, 1, D)).astype(np.float32))
    kp, vp = (bf16(rng.standard_normal((blocks, hkv, BLOCK, D)).astype(np.float32)) for _ in range(2))
    return q, kp, vp, table, np.array(lengths)


def gathered(q, kp, vp, table, lengths, scale):  # type: ignore[no-untyped-def]
    """float64 softmax attention over each row's positions, gathered from its blocks."""
    B, HQ, _, D = q.shape
    R = HQ // kp.shape[1]
    out = np.zeros(q.shape, np.float64)
    for b in range(B):
        n = int(lengths[b])
        k = kp[table[b]].transpose(1, 0, 2, 3).reshape(kp.shape[1], -1, D)[:, :n]
        v = vp[table[b]].transpose(1, 0, 2, 3).reshape(vp.shape[1], -1, D)[:, :n]
        for hq in range(HQ):
            s = scale * (k[hq // R].astype(np.float64) @ q[b, hq, 0].astype(np.float64))
            p = np.exp(s - s.max())
            out[b, hq, 0] = (p / p.sum()) @ v[hq // R]
    return out


@pytest.mark.parametrize(
    ("D", "group", "lengths"),
    [(128, 4, [300, 37]), (64, 2, [2 * BLOCK, 1]), (64, 16, [BLOCK + 1, 20])],
    ids=["d128-r4-two-blocks", "d64-r2-block-ends", "d64-r16"],
)
def test_emulated_kernel_equals_attention_over_the_gathered_rows(D, group, lengths):
    q, kp, vp, table, lens = case(D, group, lengths, seed=D + group)
    scale = D**-0.5
    got = emulate(q, kp, vp, table, lens, scale)
    want = gathered(q, kp, vp, table, lens, scale)
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
    # The check can fail: rows reading each other's blocks differ.
    swapped = emulate(q, kp, vp, table[::-1].copy(), lens[::-1].copy(), scale)
    assert np.abs(swapped - want).max() > 1e-1 * np.abs(want).max()


def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    q, kp, vp, table, lens = case(64, 4, [600, 40, 300], seed=5)
    together = emulate(q, kp, vp, table, lens, 0.125)
    for i in (1, 2):
        n = -(-int(lens[i]) // BLOCK)
        alone = emulate(q[i : i + 1], kp, vp, table[i : i + 1, :n], lens[i : i + 1], 0.125)
        assert np.array_equal(alone[0], together[i])

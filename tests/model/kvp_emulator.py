"""A NumPy emulation of model/kv/paged_kernel.py's decode attention, lane by lane: the block a
warp reads through its row's table, the queries' A fragments and the keys' B fragments in the
lane's dims (D/4 t + 4s + ...), mma.sync m16n8k16 by its fragment layout, the online softmax
across the quad, the values staged in shared memory and read back by `ldmatrix.x4.trans`, P @ V
from the score fragments, and the combine of a row's blocks in order. Checks the kernel's index
arithmetic on the CPU."""

from __future__ import annotations

import numpy as np

from tests.model.kvq_emulator import combine, online_softmax, partials, pv_product
from tests.model.qmm_emulator import bf16, mma

BLOCK = 256


def _block_partials(
    q: np.ndarray, kblk: np.ndarray, vblk: np.ndarray, t_begin: int, t_end: int, R: int, sc: np.float32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One warp: query heads q [R, D] of a KV head over one block's keys / values [BLOCK, D],
    positions [t_begin, t_end) of the row (the block's slot p - t_begin). (max, sum, acc)."""
    D = q.shape[-1]
    ksteps = D // 16
    qa = np.zeros((32, ksteps, 4, 2), np.float32)  # per lane and k step: a0..a3 as value pairs
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for s in range(ksteps):
            for hh in range(2):
                r = g + 8 * hh
                if r < R:
                    base = (D // 4) * t + 4 * s
                    qa[lane, s, hh], qa[lane, s, 2 + hh] = q[r, base : base + 2], q[r, base + 2 : base + 4]
    m_run = np.full((32, 2), -np.inf, np.float32)
    l_run = np.zeros((32, 2), np.float32)
    acc = np.zeros((D // 8, 32, 4), np.float64)  # [dim tile][lane][c]
    for t0 in range(t_begin, t_end, 16):
        sc_frag = np.zeros((2, 32, 4), np.float32)
        for j in range(2):
            c4 = np.zeros((32, 4), np.float64)
            for s in range(ksteps):
                a_regs, b_regs = [], []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    p = t0 + 8 * j + g
                    assert p - t_begin < BLOCK  # every read lies in the block
                    words = kblk[p - t_begin, (D // 4) * t : (D // 4) * (t + 1)]  # the lane's D/8 words
                    a_regs.append(tuple(qa[lane, s, i] for i in range(4)))
                    b_regs.append((words[4 * s : 4 * s + 2], words[4 * s + 2 : 4 * s + 4]))
                mma(c4, a_regs, b_regs)
            for lane in range(32):
                t = lane & 3
                for c in range(4):
                    p2 = t0 + 8 * j + 2 * t + (c & 1)
                    sc_frag[j, lane, c] = np.float32(c4[lane, c]) * sc if p2 < t_end else -np.inf
        pa = online_softmax(sc_frag, m_run, l_run, acc)
        vsm = np.zeros((16, D + 8), np.float32)
        for lane in range(32):
            pp, half = lane >> 1, lane & 1
            dims = slice((D // 2) * half, (D // 2) * (half + 1))
            if t0 + pp < t_end:
                vsm[pp, dims] = vblk[t0 + pp - t_begin, dims]
        pv_product(acc, vsm, pa)
    return partials(m_run, l_run, acc, R)


def emulate(
    q: np.ndarray, kp: np.ndarray, vp: np.ndarray, table: np.ndarray, lengths: np.ndarray, scale: float
) -> np.ndarray:
    """q [B, Hq, 1, D] (bf16 values as float32); kp / vp [blocks, Hkv, BLOCK, D] (likewise);
    table [B, C] block ids; lengths [B]. Returns [B, Hq, 1, D] (bf16-rounded)."""
    B, HQ, _, D = q.shape
    HKV, C = kp.shape[1], table.shape[1]
    R = HQ // HKV
    sc = np.float32(scale * 1.4426950408889634)
    out = np.zeros((B, HQ, 1, D), np.float32)
    for b in range(B):
        for h in range(HKV):
            parts = []
            for chunk in range(C):
                t_begin = chunk * BLOCK
                t_end = min(int(lengths[b]), t_begin + BLOCK)
                blk = int(table[b, chunk]) if t_end > t_begin else 0
                heads = q[b, h * R : h * R + R, 0]
                parts.append(_block_partials(heads, kp[blk, h], vp[blk, h], t_begin, t_end, R, sc))
            o = combine(parts)
            out[b, h * R : h * R + R, 0] = bf16(o)
    return out

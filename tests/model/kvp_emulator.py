"""A NumPy emulation of model/kv/paged_kernel.py's decode attention, lane by lane: the block a
warp reads through its row's table, the queries' A fragments and the keys' B fragments in the
lane's dims (D/4 t + 4s + ...), mma.sync m16n8k16 by its fragment layout, the online softmax
across the quad, the values staged in shared memory and read back by `ldmatrix.x4.trans`, P @ V
from the score fragments, and the combine of a row's blocks in order. Checks the kernel's index
arithmetic on the CPU."""

from __future__ import annotations

import numpy as np

from tests.model.kvq_emulator import ldmatrix_x4_trans
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
        pr = np.zeros((2, 32, 4), np.float32)
        for hh in range(2):
            for quad in range(8):
                lanes = [4 * quad + t for t in range(4)]
                vals = sc_frag[:, lanes][:, :, [2 * hh, 2 * hh + 1]]
                m_new = max(m_run[lanes[0], hh], vals.max())
                m_use = 0.0 if m_new == -np.inf else m_new
                alpha = np.exp2(np.float32(m_run[lanes[0], hh] - m_use))
                pv = np.exp2(vals - np.float32(m_use))
                for i, lane in enumerate(lanes):
                    pr[:, lane, 2 * hh : 2 * hh + 2] = pv[:, i]
                    l_run[lane, hh] = l_run[lane, hh] * alpha + pv.sum()
                    m_run[lane, hh] = m_new
                    acc[:, lane, 2 * hh : 2 * hh + 2] *= alpha
        pa = [
            (bf16(pr[0, lane, 0:2]), bf16(pr[0, lane, 2:4]), bf16(pr[1, lane, 0:2]), bf16(pr[1, lane, 2:4]))
            for lane in range(32)
        ]
        vsm = np.zeros((16, D + 8), np.float32)
        for lane in range(32):
            pp, half = lane >> 1, lane & 1
            dims = slice((D // 2) * half, (D // 2) * (half + 1))
            if t0 + pp < t_end:
                vsm[pp, dims] = vblk[t0 + pp - t_begin, dims]
        for j in range(0, D // 8, 2):
            addrs = [((lane & 7) + 8 * ((lane >> 3) & 1), 8 * (j + ((lane >> 3) >> 1))) for lane in range(32)]
            regs = ldmatrix_x4_trans(vsm, addrs)
            mma(acc[j], pa, [(regs[lane][0], regs[lane][1]) for lane in range(32)])
            mma(acc[j + 1], pa, [(regs[lane][2], regs[lane][3]) for lane in range(32)])
    pm = np.full(R, -np.inf, np.float32)
    pl = np.zeros(R, np.float32)
    pacc = np.zeros((R, D), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for hh in range(2):
            r = g + 8 * hh
            if r >= R:
                continue
            pm[r], pl[r] = m_run[lane, hh], l_run[lane, hh]
            for j in range(D // 8):
                pacc[r, 8 * j + 2 * t] = acc[j, lane, 2 * hh]
                pacc[r, 8 * j + 2 * t + 1] = acc[j, lane, 2 * hh + 1]
    return pm, pl, pacc


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
            M = np.max(np.stack([p[0] for p in parts]), axis=0)
            L = np.zeros(R, np.float32)
            o = np.zeros((R, D), np.float32)
            for pm, pl, pacc in parts:  # the blocks in order
                w = np.where(pm == -np.inf, 0.0, np.exp2(pm - M)).astype(np.float32)
                L = L + w * pl
                o = o + w[:, None] * pacc
            out[b, h * R : h * R + R, 0] = bf16(o / L[:, None])
    return out

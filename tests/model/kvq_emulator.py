"""A NumPy emulation of model/kv/quant_kernel.py's decode attention, lane by lane: the queries'
A fragments in the keys' permuted order, the keys dequantized into B fragments, mma.sync
m16n8k16 by its fragment layout, the online softmax across the quad, the values dequantized
into shared memory and read back by `ldmatrix.x4.trans`, P @ V from the score fragments, and the
chunk combine. Checks the kernel's index arithmetic on the CPU."""

from __future__ import annotations

import numpy as np

from tests.model.qmm_emulator import bf16, mma


def _groups(packed: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint32 words -> their unsigned values, element order."""
    per = 32 // bits
    vals = np.stack([(packed >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], -1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def ldmatrix_x4_trans(smem: np.ndarray, addrs: list[tuple[int, int]]) -> list[list[np.ndarray]]:
    """smem [rows, cols] of 16-bit values; lane l gives the (row, col) start of row l % 8 of matrix
    l // 8. Returns per lane the 4 registers as value pairs: with .trans lane (g, t) receives
    (M[2t][g], M[2t+1][g]) of each 8x8 matrix M."""
    mats = []
    for m in range(4):
        rows = [smem[addrs[8 * m + r][0], addrs[8 * m + r][1] : addrs[8 * m + r][1] + 8] for r in range(8)]
        mats.append(np.stack(rows))  # [8 rows][8 cols]
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out.append([np.array([mats[m][2 * t, g], mats[m][2 * t + 1, g]]) for m in range(4)])
    return out


# The parts both decode attention kernels share (model/kv/split_attention.py: ONLINE_SOFTMAX,
# PV_PRODUCT, PARTIALS and the combine), emulated once for both.


def online_softmax(sc_frag: np.ndarray, m_run: np.ndarray, l_run: np.ndarray, acc: np.ndarray) -> list[tuple]:
    """A 16-position tile's scores sc_frag [2][lane][4] into each quad's running max / sum (m_run,
    l_run [lane][2]), acc [D/8][lane][4] rescaled; returns P as each lane's A fragment."""
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
    return [
        (bf16(pr[0, lane, 0:2]), bf16(pr[0, lane, 2:4]), bf16(pr[1, lane, 0:2]), bf16(pr[1, lane, 2:4]))
        for lane in range(32)
    ]


def pv_product(acc: np.ndarray, vsm: np.ndarray, pa: list[tuple]) -> None:
    """acc += P @ V, V's B fragments read from the shared tile vsm [16, D + 8] by ldmatrix.trans."""
    for j in range(0, acc.shape[0], 2):
        addrs = [((lane & 7) + 8 * ((lane >> 3) & 1), 8 * (j + ((lane >> 3) >> 1))) for lane in range(32)]
        regs = ldmatrix_x4_trans(vsm, addrs)
        mma(acc[j], pa, [(regs[lane][0], regs[lane][1]) for lane in range(32)])
        mma(acc[j + 1], pa, [(regs[lane][2], regs[lane][3]) for lane in range(32)])


def partials(m_run: np.ndarray, l_run: np.ndarray, acc: np.ndarray, R: int) -> tuple[np.ndarray, ...]:
    """A warp's partials per head row: (max, sum, unnormalized output [R, D])."""
    D = 8 * acc.shape[0]
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


def combine(parts: list[tuple[np.ndarray, ...]]) -> np.ndarray:
    """The combine kernel: the chunks' partials (max, sum, acc) in order -> the output [R, D]."""
    M = np.max(np.stack([pm for pm, _, _ in parts]), axis=0)
    L = np.zeros(M.shape, np.float32)
    o = np.zeros(parts[0][2].shape, np.float32)
    for pm, pl, pacc in parts:
        w = np.where(pm == -np.inf, 0.0, np.exp2(pm - M)).astype(np.float32)
        L = L + w * pl
        o = o + w[:, None] * pacc
    return o / L[:, None]


def emulate(
    q: np.ndarray,
    k: tuple[np.ndarray, np.ndarray, np.ndarray],
    v: tuple[np.ndarray, np.ndarray, np.ndarray],
    scale: float,
    lp: np.ndarray,
    bits: int,
    chunk: int,
) -> np.ndarray:
    """q [B, Hq, 1, 128] float (bf16 values); k/v: (packed uint32 [B, Hkv, T, W], scales, biases
    [B, Hkv, T, G]); lp [B]. Returns [B, Hq, 1, 128] (bf16-rounded)."""
    B, HQ, _, D = q.shape
    HKV, TT = k[0].shape[1], k[0].shape[2]
    R = HQ // HKV
    G = k[1].shape[-1]
    gs = D // G
    kq, vq = _groups(k[0], bits), _groups(v[0], bits)  # [B, Hkv, T, D] ints
    C = -(-TT // chunk)
    sc = np.float32(scale * 1.4426950408889634)
    out = np.zeros((B, HQ, 1, D), np.float32)
    for b in range(B):
        lo = max(int(lp[b]), 0)
        for h in range(HKV):
            parts = []
            for c_ in range(C):
                t_begin = lo + c_ * chunk
                t_end = min(TT, t_begin + chunk)
                # query A fragments, per lane and k step
                qa = np.zeros((32, 8, 4, 2), np.float32)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for s in range(8):
                        for hh in range(2):
                            r = g + 8 * hh
                            if r >= R:
                                continue
                            qr = q[b, h * R + r, 0, 32 * t : 32 * t + 32]
                            if bits == 4:
                                base = 8 * (s >> 1) + 2 * (s & 1)
                                lo_p, hi_p = qr[[base, base + 4]], qr[[base + 1, base + 5]]
                            else:
                                lo_p, hi_p = qr[4 * s : 4 * s + 2], qr[4 * s + 2 : 4 * s + 4]
                            qa[lane, s, hh], qa[lane, s, 2 + hh] = lo_p, hi_p
                m_run = np.full((32, 2), -np.inf, np.float32)
                l_run = np.zeros((32, 2), np.float32)
                acc = np.zeros((16, 32, 4), np.float64)  # [dim tile][lane][c]
                for t0 in range(t_begin, t_end, 16):
                    sc_frag = np.zeros((2, 32, 4), np.float32)
                    for j in range(2):
                        c4 = np.zeros((32, 4), np.float64)
                        for s in range(8):
                            a_regs, b_regs = [], []
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                p = t0 + 8 * j + g
                                a_regs.append(tuple(qa[lane, s, i] for i in range(4)))
                                if p < TT:
                                    dims = 32 * t + np.arange(32)
                                    gi = (32 * t) // gs
                                    kv = kq[b, h, p, dims].astype(np.float32)
                                    w = bf16(kv * k[1][b, h, p, gi] + k[2][b, h, p, gi])
                                    if bits == 4:
                                        base = 8 * (s >> 1) + 2 * (s & 1)
                                        b0, b1 = w[[base, base + 4]], w[[base + 1, base + 5]]
                                    else:
                                        b0, b1 = w[4 * s : 4 * s + 2], w[4 * s + 2 : 4 * s + 4]
                                else:
                                    b0 = b1 = np.zeros(2, np.float32)
                                b_regs.append((b0, b1))
                            mma(c4, a_regs, b_regs)
                        for lane in range(32):
                            t = lane & 3
                            for c in range(4):
                                p2 = t0 + 8 * j + 2 * t + (c & 1)
                                sc_frag[j, lane, c] = np.float32(c4[lane, c]) * sc if lo <= p2 < t_end else -np.inf
                    pa = online_softmax(sc_frag, m_run, l_run, acc)
                    # values into shared memory
                    vsm = np.zeros((16, D + 8), np.float32)
                    for lane in range(32):
                        pp, half = lane >> 1, lane & 1
                        p = t0 + pp
                        if lo <= p < t_end:
                            for d in range(64 * half, 64 * half + 64):
                                gi = d // gs
                                vsm[pp, d] = bf16(np.float32(vq[b, h, p, d]) * v[1][b, h, p, gi] + v[2][b, h, p, gi])
                    pv_product(acc, vsm, pa)
                parts.append(partials(m_run, l_run, acc, R))
            o = combine(parts)
            out[b, h * R : h * R + R, 0] = bf16(o)
    return out

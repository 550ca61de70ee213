"""A NumPy emulation of model/quant_kernel.py's CUDA kernel, lane by lane: the same staging of x
into shared memory (padded, swizzled), the same weight loads, the same pairing of dequantized
values into mma fragments, `mma.sync` m16n8k16 by its documented fragment layout, and the same
reductions and output positions. It checks the kernel's index arithmetic on the CPU: tests
compare it to a plain product of the dequantized weights.

Names follow the kernel body (`_BODY`): g = lane >> 2, t = lane & 3, wn/wk the warp's place.
"""

from __future__ import annotations

import numpy as np

from model.quant_kernel import Config


def bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), kept as float32."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def f16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def mma(acc: np.ndarray, a_regs: list, b_regs: list) -> None:
    """m16n8k16: lane (g, t) holds a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10],
    a3 = A[g+8, 2t+8:2t+10]; b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]; c0,c1 = D[g, 2t:2t+2],
    c2,c3 = D[g+8, 2t:2t+2]. `a_regs[lane]` = (a0, a1, a2, a3) as value pairs, `acc[lane]` [4]."""
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a0, a1, a2, a3 = a_regs[lane]
        A[g, 2 * t : 2 * t + 2] = a0
        A[g + 8, 2 * t : 2 * t + 2] = a1
        A[g, 2 * t + 8 : 2 * t + 10] = a2
        A[g + 8, 2 * t + 8 : 2 * t + 10] = a3
        b0, b1 = b_regs[lane]
        B[2 * t : 2 * t + 2, g] = b0
        B[2 * t + 8 : 2 * t + 10, g] = b1
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[lane, 0] += D[g, 2 * t]
        acc[lane, 1] += D[g, 2 * t + 1]
        acc[lane, 2] += D[g + 8, 2 * t]
        acc[lane, 3] += D[g + 8, 2 * t + 1]


def emulate(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    cfg: Config,
    maxnt: int,
    *,
    experts: np.ndarray | None = None,
    rowmap: np.ndarray | None = None,
    half: bool = False,
) -> np.ndarray:
    """The kernel's output. Dense: x [M, K], packed [N, K*bits/32], scales/biases [N, K/gs].
    Gather: packed [E, N, ...], `experts` sorted [P], `rowmap` [P]: output [P, N]."""
    rnd = f16 if half else bf16
    gather = experts is not None
    WN, WK, S, U = cfg.wn, cfg.wk, cfg.s, cfg.u
    CK = 128 if bits == 4 else 64
    KC = CK * WK
    LK = CK // 4
    V = LK // 8
    PAD = 16 if bits == 4 else 8
    ROW = KC + PAD
    MAXROWS = maxnt * 8
    TILE = 16 * WN
    N = packed.shape[-2]
    KW = packed.shape[-1]
    K = KW * (32 // bits)
    KG = scales.shape[-1]
    gshift = int(np.log2(K // KG))
    ksplit = K // S
    n_it = ksplit // KC
    n_out = experts.size if gather else x.shape[0]
    y = np.full((n_out, N), np.nan, np.float32)
    tiles = -(-N // TILE)
    n_experts = packed.shape[0] if gather else 1
    assert U >= 1
    for e_ in range(n_experts):
        if gather:
            assert experts is not None and rowmap is not None
            r_begin = int(np.searchsorted(experts, e_, "left"))
            r_end = int(np.searchsorted(experts, e_, "right"))
            if r_begin == r_end:
                continue
            wb, sb, bb = packed[e_], scales[e_], biases[e_]
        else:
            r_begin, r_end = 0, x.shape[0]
            wb, sb, bb = packed, scales, biases
        for tile in range(tiles):
            for r0 in range(r_begin, r_end, MAXROWS):
                rows = min(MAXROWS, r_end - r0)
                nt = (rows + 7) >> 3
                fins = {}
                for split in range(S):
                    k_begin = split * ksplit
                    acc = np.zeros((WK, WN, maxnt, 32, 4), np.float64)
                    for it in range(n_it):
                        # stage: shared x for this block iteration
                        xs = np.full((MAXROWS, ROW), np.nan, np.float32)
                        kc0 = k_begin + it * KC
                        CH = KC // 8
                        for c in range(rows * CH):
                            r, kk = c // CH, (c % CH) * 8
                            wk_, within = kk // CK, kk % CK
                            tt, v = within // LK, (within % LK) // 8
                            vs = (v ^ (tt >> 1)) if bits == 4 else v
                            d = wk_ * CK + tt * LK + vs * 8
                            xr = int(rowmap[r0 + r]) if gather else r0 + r  # type: ignore[index]
                            xs[r, d : d + 8] = x[xr, kc0 + kk : kc0 + kk + 8]
                        for wk in range(WK):
                            for wn in range(WN):
                                n_warp = tile * TILE + wn * 16
                                if n_warp >= N:
                                    continue
                                # per-lane weights of this iteration
                                wq = np.zeros((32, 2, 4), np.uint32)
                                ws = np.zeros((32, 2), np.float32)
                                wz = np.zeros((32, 2), np.float32)
                                for lane in range(32):
                                    g, t = lane >> 2, lane & 3
                                    kl = k_begin + it * KC + wk * CK + t * LK
                                    for h in range(2):
                                        n = n_warp + g + 8 * h
                                        w0 = kl // (32 // bits)
                                        wq[lane, h] = wb[n, w0 : w0 + 4]
                                        gi = kl >> gshift
                                        ws[lane, h], wz[lane, h] = sb[n, gi], bb[n, gi]
                                for v in range(V):
                                    xv = np.zeros((32, maxnt, 8), np.float32)
                                    for lane in range(32):
                                        g, t = lane >> 2, lane & 3
                                        vs = (v ^ (t >> 1)) if bits == 4 else v
                                        base = wk * CK + t * LK + vs * 8
                                        for j in range(maxnt):
                                            if j < nt and 8 * j + g < rows:
                                                xv[lane, j] = xs[8 * j + g, base : base + 8]
                                    for h in range(2):
                                        a_regs, b_by_j = [], [[] for _ in range(maxnt)]
                                        for lane in range(32):

                                            def dq(word: int, shift: int, lane: int = lane, hh: int = 0) -> np.ndarray:
                                                qa = (int(word) >> shift) & 0xF
                                                qb = (int(word) >> (shift + 16)) & 0xF
                                                s_, b_ = ws[lane, hh], wz[lane, hh]
                                                return rnd(np.array([qa * s_ + b_, qb * s_ + b_], np.float32))

                                            def dq8(word: int, i: int, lane: int = lane, hh: int = 0) -> np.ndarray:
                                                qa = (int(word) >> (8 * i)) & 0xFF
                                                qb = (int(word) >> (8 * (i + 1))) & 0xFF
                                                s_, b_ = ws[lane, hh], wz[lane, hh]
                                                return rnd(np.array([qa * s_ + b_, qb * s_ + b_], np.float32))

                                            if bits == 4:
                                                w0, w1 = wq[lane, 0, v], wq[lane, 1, v]
                                                sh = 0 if h == 0 else 8
                                                a_regs.append(
                                                    (
                                                        dq(w0, sh, hh=0),
                                                        dq(w1, sh, hh=1),
                                                        dq(w0, sh + 4, hh=0),
                                                        dq(w1, sh + 4, hh=1),
                                                    )
                                                )
                                            else:
                                                w0, w1 = wq[lane, 0, 2 * v + h], wq[lane, 1, 2 * v + h]
                                                a_regs.append(
                                                    (
                                                        dq8(w0, 0, hh=0),
                                                        dq8(w1, 0, hh=1),
                                                        dq8(w0, 2, hh=0),
                                                        dq8(w1, 2, hh=1),
                                                    )
                                                )
                                            for j in range(maxnt):
                                                xe = xv[lane, j]
                                                if bits == 4:
                                                    i = 2 * h
                                                    b0 = np.array([xe[i], xe[i + 4]])
                                                    b1 = np.array([xe[i + 1], xe[i + 5]])
                                                else:
                                                    b0 = xe[4 * h : 4 * h + 2]
                                                    b1 = xe[4 * h + 2 : 4 * h + 4]
                                                b_by_j[j].append((b0, b1))
                                        for j in range(maxnt):
                                            if j < nt:
                                                mma(acc[wk, wn, j], a_regs, b_by_j[j])
                    # in-block reduction over wk, in order (float32 adds like the kernel)
                    fin = np.zeros((WN, maxnt, 32, 4), np.float32)
                    for wk in range(WK):
                        fin = (fin + acc[wk].astype(np.float32)).astype(np.float32)
                    fins[split] = fin
                # the cluster: ranks added in order
                total = np.zeros((WN, maxnt, 32, 4), np.float32)
                for split in range(S):
                    total = (total + fins[split]).astype(np.float32)
                for wn in range(WN):
                    for j in range(nt):
                        for lane in range(32):
                            for c in range(4):
                                m = 8 * j + 2 * (lane & 3) + (c & 1)
                                n = tile * TILE + wn * 16 + (lane >> 2) + 8 * (c >> 1)
                                if m < rows and n < N:
                                    y[r0 + m, n] = rnd(np.array([total[wn, j, lane, c]]))[0]
    return y

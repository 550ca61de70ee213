"""CUDA source of model/quant_kernel.py's kernel (the dense and the routed-experts product of
affine-quantized weights and a few rows of activations): `HEADER`, device helpers shared with
model/kv/quant_kernel.py, and `BODY`, the kernel body that model/kernels/cuda_build.py wraps in its
generated signature. model/quant_kernel.py describes the design and bakes in the constants.
"""

HEADER = r"""
#include <cuda/std/type_traits>
#define QMM_DEVICE __device__ __forceinline__

QMM_DEVICE uint32_t qmm_pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
QMM_DEVICE uint32_t qmm_pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// (q_lo, q_hi) * scale + bias for two exact small integers held as bf16/f16 pairs: one rounding.
template <typename T>
QMM_DEVICE uint32_t qmm_fma2(uint32_t q, uint32_t s2, uint32_t b2) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 r = __hfma2(*reinterpret_cast<__nv_bfloat162*>(&q), *reinterpret_cast<__nv_bfloat162*>(&s2),
                               *reinterpret_cast<__nv_bfloat162*>(&b2));
    return *reinterpret_cast<uint32_t*>(&r);
  } else {
    __half2 r = __hfma2(*reinterpret_cast<__half2*>(&q), *reinterpret_cast<__half2*>(&s2),
                        *reinterpret_cast<__half2*>(&b2));
    return *reinterpret_cast<uint32_t*>(&r);
  }
}

// Two 4-bit values of a packed word, nibbles SHIFT/4 and SHIFT/4 + 4 (elements i and i + 4), as a
// dequantized pair: the nibbles land in the low mantissa bits of 128.0 (bf16) or 1024.0 (f16),
// an exact subtraction leaves q, and one fma applies the scale and bias.
template <typename T, int SHIFT>
QMM_DEVICE uint32_t qmm_dq4(uint32_t w, uint32_t s2, uint32_t b2) {
  constexpr uint32_t MAGIC = cuda::std::is_same_v<T, __nv_bfloat16> ? 0x43004300u : 0x64006400u;
  uint32_t v = ((w >> SHIFT) & 0x000F000Fu) | MAGIC;
  uint32_t q;
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&v),
                               *reinterpret_cast<const __nv_bfloat162*>(&MAGIC));
    q = *reinterpret_cast<uint32_t*>(&r);
  } else {
    __half2 r = __hsub2(*reinterpret_cast<__half2*>(&v), *reinterpret_cast<const __half2*>(&MAGIC));
    q = *reinterpret_cast<uint32_t*>(&r);
  }
  return qmm_fma2<T>(q, s2, b2);
}

// Byte I of w as an exact float (it lands in the mantissa of 2^23).
template <int I>
QMM_DEVICE float qmm_byte(uint32_t w) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + I)) - 8388608.0f;
}

// Bytes I and I + 1 of a packed 8-bit word (consecutive k), dequantized, as a pair.
template <typename T, int I>
QMM_DEVICE uint32_t qmm_dq8(uint32_t w, uint32_t s2, uint32_t b2) {
  const float lo = qmm_byte<I>(w), hi = qmm_byte<I + 1>(w);
  const uint32_t q = cuda::std::is_same_v<T, __nv_bfloat16> ? qmm_pack_bf16(lo, hi) : qmm_pack_f16(lo, hi);
  return qmm_fma2<T>(q, s2, b2);
}

template <typename T>
QMM_DEVICE void qmm_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// 16 bytes of weights that no other block reads again: past L1.
QMM_DEVICE uint4 qmm_ld_stream(const uint32_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

QMM_DEVICE void qmm_cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
QMM_DEVICE void qmm_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
QMM_DEVICE void qmm_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

QMM_DEVICE uint32_t qmm_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
"""

# y[m, n] = sum_k x[row(m), k] * (scale[n, k / GS] * q[n, k] + bias[n, k / GS]) for the block's
# tile of output columns; see the module docstring. The constants (T, BITS, MAXNT, WN, WK, S, U,
# GATHER via QMM_GATHER) come first, from `_source`.
BODY = r"""
    constexpr int THREADS = 32 * WN * WK;
    constexpr int CK = BITS == 4 ? 128 : 64;  // k per warp iteration: 16 bytes per lane and row
    constexpr int KC = CK * WK;               // k per block iteration
    constexpr int LK = CK / 4;                // k per lane per iteration (32 or 16)
    constexpr int V = LK / 8;                 // 16-byte vectors of x per lane (4 or 2)
    constexpr int PAD = BITS == 4 ? 16 : 8;   // shared x row padding, in elements (32 or 16 bytes)
    constexpr int ROW = KC + PAD;             // shared x row stride, in elements
    constexpr int MAXROWS = MAXNT * 8;
    constexpr int TILE = 16 * WN;             // output columns per block
    constexpr int XS = 2 * MAXROWS * ROW;     // double-buffered x, in elements
    constexpr int RED = WK * WN * MAXNT * 128;  // per-warp partial sums, in floats

    extern __shared__ __align__(16) unsigned char qmm_smem[];
    T* xs = reinterpret_cast<T*>(qmm_smem);
    float* red = reinterpret_cast<float*>(qmm_smem);
    float* fin = red + RED;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int g = lane >> 2, t = lane & 3;
    const int split = blockIdx.x % S, tile = blockIdx.x / S;

    const int N = w_shape[QMM_GATHER ? 1 : 0];
    const int KW = w_shape[QMM_GATHER ? 2 : 1];  // packed words per weight row
    const int K = KW * (32 / BITS);
    const int KG = scales_shape[QMM_GATHER ? 2 : 1];
    const int gshift = 31 - __clz(K / KG);   // log2(group size)
    const int ksplit = K / S;
    const int k_begin = split * ksplit;
    const int n_it = ksplit / KC;
    const int n_warp = tile * TILE + wn * 16;
    const bool wvalid = n_warp < N;

#if QMM_GATHER
    // This block's expert and its run of pairs in the expert-sorted list.
    const int e = blockIdx.y;
    const int P = idx_shape[0];
    int lo = 0, hi = P;
    while (lo < hi) { const int mid = (lo + hi) >> 1; if ((int)idx[mid] < e) lo = mid + 1; else hi = mid; }
    const int r_begin = lo;
    hi = P;
    while (lo < hi) { const int mid = (lo + hi) >> 1; if ((int)idx[mid] <= e) lo = mid + 1; else hi = mid; }
    const int r_end = lo;
    if (r_begin == r_end) return;  // (the whole cluster: the same expert)
#else
    const int e = 0, r_begin = 0, r_end = x_shape[0];
#endif
    const uint32_t* wb = w + (size_t)e * N * KW;
    const T* sb = scales + (size_t)e * N * KG;
    const T* bb = biases + (size_t)e * N * KG;
    const bool x_aligned = (reinterpret_cast<uintptr_t>(x) & 15) == 0 && (K & 7) == 0;
    const bool w_aligned = (reinterpret_cast<uintptr_t>(w) & 15) == 0;

    for (int r0 = r_begin; r0 < r_end; r0 += MAXROWS) {
        const int rows = min(MAXROWS, r_end - r0);
        const int nt = (rows + 7) >> 3;

        // Stage x[rows, KC] of block iteration `it` into buffer `buf`: lane t of warp column wk
        // reads k in [wk * CK + t * LK, + LK) as V 16-byte vectors; vector v of a 4-bit lane sits
        // at slot v ^ (t >> 1) so a quarter warp's 16-byte reads hit distinct banks.
        auto stage = [&](int buf, int it) {
            T* dst = xs + buf * (MAXROWS * ROW);
            const int kc0 = k_begin + it * KC;
            constexpr int CH = KC / 8;
            for (int c = threadIdx.x; c < rows * CH; c += THREADS) {
                const int r = c / CH, kk = (c % CH) * 8;
                const int wk_ = kk / CK, within = kk % CK, tt = within / LK, v = (within % LK) / 8;
                const int vs = BITS == 4 ? (v ^ (tt >> 1)) : v;
                T* d = dst + r * ROW + wk_ * CK + tt * LK + vs * 8;
#if QMM_GATHER
                const int xr = (int)rowmap[r0 + r];
#else
                const int xr = r0 + r;
#endif
                const T* src = x + (size_t)xr * K + kc0 + kk;
                if (x_aligned) {
                    qmm_cp_async16(d, src);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) d[i] = src[i];
                }
            }
            qmm_cp_commit();
        };

        // The weight stream: U iterations in flight per lane (rows g and g + 8 of the warp's 16).
        uint4 wq[U][2];
        uint32_t ws[U][2], wz[U][2];
        auto wload = [&](int u, int it) {
            if (!wvalid) return;
            const int kl = k_begin + it * KC + wk * CK + t * LK;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = n_warp + g + 8 * h;
                const uint32_t* p = wb + (size_t)n * KW + kl / (32 / BITS);
                if (w_aligned) {
                    wq[u][h] = qmm_ld_stream(p);
                } else {
                    wq[u][h] = make_uint4(p[0], p[1], p[2], p[3]);
                }
                const size_t gi = (size_t)n * KG + (kl >> gshift);
                const T s = sb[gi], b = bb[gi];
                const uint16_t su = *reinterpret_cast<const uint16_t*>(&s);
                const uint16_t bu = *reinterpret_cast<const uint16_t*>(&b);
                ws[u][h] = (uint32_t)su | ((uint32_t)su << 16);
                wz[u][h] = (uint32_t)bu | ((uint32_t)bu << 16);
            }
        };

        float acc[MAXNT][4];
#pragma unroll
        for (int j = 0; j < MAXNT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[j][c] = 0.0f;

        // One warp iteration on the weights of stage u against the staged x in `xb`.
        auto compute = [&](int u, const T* xb) {
            if (!wvalid) return;
            const T* xl = xb + wk * CK + t * LK;
#pragma unroll
            for (int v = 0; v < V; ++v) {
                uint4 xv[MAXNT];
                const int vs = BITS == 4 ? (v ^ (t >> 1)) : v;
#pragma unroll
                for (int j = 0; j < MAXNT; ++j) {
                    xv[j] = make_uint4(0, 0, 0, 0);
                    if (j < nt && 8 * j + g < rows) {
                        xv[j] = *reinterpret_cast<const uint4*>(xl + (8 * j + g) * ROW + vs * 8);
                    }
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    uint32_t a0, a1, a2, a3;
                    if constexpr (BITS == 4) {
                        // word v holds elements 8v..8v+7 of the lane's range; half h pairs
                        // (e_i, e_i+4) and (e_i+1, e_i+5) with i = 2h.
                        const uint32_t w0 = qmm_word(wq[u][0], v), w1 = qmm_word(wq[u][1], v);
                        if (h == 0) {
                            a0 = qmm_dq4<T, 0>(w0, ws[u][0], wz[u][0]);
                            a1 = qmm_dq4<T, 0>(w1, ws[u][1], wz[u][1]);
                            a2 = qmm_dq4<T, 4>(w0, ws[u][0], wz[u][0]);
                            a3 = qmm_dq4<T, 4>(w1, ws[u][1], wz[u][1]);
                        } else {
                            a0 = qmm_dq4<T, 8>(w0, ws[u][0], wz[u][0]);
                            a1 = qmm_dq4<T, 8>(w1, ws[u][1], wz[u][1]);
                            a2 = qmm_dq4<T, 12>(w0, ws[u][0], wz[u][0]);
                            a3 = qmm_dq4<T, 12>(w1, ws[u][1], wz[u][1]);
                        }
                    } else {
                        // step 2v + h is word 2v + h: bytes (0, 1) and (2, 3), consecutive k.
                        const uint32_t w0 = qmm_word(wq[u][0], 2 * v + h), w1 = qmm_word(wq[u][1], 2 * v + h);
                        a0 = qmm_dq8<T, 0>(w0, ws[u][0], wz[u][0]);
                        a1 = qmm_dq8<T, 0>(w1, ws[u][1], wz[u][1]);
                        a2 = qmm_dq8<T, 2>(w0, ws[u][0], wz[u][0]);
                        a3 = qmm_dq8<T, 2>(w1, ws[u][1], wz[u][1]);
                    }
#pragma unroll
                    for (int j = 0; j < MAXNT; ++j) {
                        if (j >= nt) continue;
                        uint32_t b0, b1;
                        const uint32_t x0 = qmm_word(xv[j], 0), x1 = qmm_word(xv[j], 1);
                        const uint32_t x2 = qmm_word(xv[j], 2), x3 = qmm_word(xv[j], 3);
                        if constexpr (BITS == 4) {
                            // (x_i, x_i+4) and (x_i+1, x_i+5), i = 2h: the weights' pairing.
                            const uint32_t lo = h == 0 ? x0 : x1, hi = h == 0 ? x2 : x3;
                            b0 = __byte_perm(lo, hi, 0x5410);
                            b1 = __byte_perm(lo, hi, 0x7632);
                        } else {
                            b0 = h == 0 ? x0 : x2;
                            b1 = h == 0 ? x1 : x3;
                        }
                        qmm_mma<T>(acc[j], a0, a1, a2, a3, b0, b1);
                    }
                }
            }
        };

        if (n_it > 0) stage(0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (u < n_it) wload(u, u);
        for (int it0 = 0; it0 < n_it; it0 += U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int it = it0 + u;
                if (it < n_it) {
                    qmm_cp_wait_all();
                    __syncthreads();
                    if (it + 1 < n_it) stage((it + 1) & 1, it + 1);
                    compute(u, xs + (it & 1) * (MAXROWS * ROW));
                    if (it + U < n_it) wload(u, it + U);
                }
            }
        }
        qmm_cp_wait_all();
        __syncthreads();  // every warp is done with xs: it becomes the reduction space

        // acc[j][c] of lane (g, t): output column n_warp + g + 8 * (c >> 1), row 8j + 2t + (c & 1).
        const size_t out0 = (size_t)r0;
        if constexpr (WK == 1 && S == 1) {
            if (wvalid) {
#pragma unroll
                for (int j = 0; j < MAXNT; ++j) {
                    if (j >= nt) continue;
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int m = 8 * j + 2 * t + (c & 1);
                        const int n = n_warp + g + 8 * (c >> 1);
                        if (m < rows) y[(out0 + m) * N + n] = static_cast<T>(acc[j][c]);
                    }
                }
            }
        } else {
            float* mine = red + (size_t)(wk * WN + wn) * (MAXNT * 128);
#pragma unroll
            for (int j = 0; j < MAXNT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) mine[j * 128 + c * 32 + lane] = acc[j][c];
            __syncthreads();
            constexpr int TOTAL = WN * MAXNT * 128;
            // Each output: the warps' partials over k in order wk = 0, 1, ...
            for (int i = threadIdx.x; i < TOTAL; i += THREADS) {
                const int wn_ = i / (MAXNT * 128), j = (i / 128) % MAXNT;
                float v = 0.0f;
                if (j < nt) {
#pragma unroll
                    for (int q = 0; q < WK; ++q) v += red[(size_t)(q * WN + wn_) * (MAXNT * 128) + i % (MAXNT * 128)];
                }
                if constexpr (S == 1) {
                    const int c = (i / 32) % 4, ln = i % 32;
                    const int m = 8 * j + 2 * (ln & 3) + (c & 1);
                    const int n = tile * TILE + wn_ * 16 + (ln >> 2) + 8 * (c >> 1);
                    if (j < nt && m < rows && n < N) y[(out0 + m) * N + n] = static_cast<T>(v);
                } else {
                    fin[i] = v;
                }
            }
#if QMM_CLUSTER
            // The S blocks of the cluster split K: block `rank` adds up its share of the outputs
            // over ranks 0..S-1, in that order, reading the others' shared memory.
            cg::cluster_group cluster = cg::this_cluster();
            cluster.sync();
            const int rank = (int)cluster.block_rank();
            for (int i = rank + S * threadIdx.x; i < TOTAL; i += S * THREADS) {
                const int wn_ = i / (MAXNT * 128), j = (i / 128) % MAXNT;
                const int c = (i / 32) % 4, ln = i % 32;
                const int m = 8 * j + 2 * (ln & 3) + (c & 1);
                const int n = tile * TILE + wn_ * 16 + (ln >> 2) + 8 * (c >> 1);
                if (j >= nt || m >= rows || n >= N) continue;
                float v = 0.0f;
#pragma unroll
                for (int q = 0; q < S; ++q) v += cluster.map_shared_rank(fin, q)[i];
                y[(out0 + m) * N + n] = static_cast<T>(v);
            }
            cluster.sync();  // the others' shared memory stays until every rank has read it
#endif
        }
        __syncthreads();
    }
"""

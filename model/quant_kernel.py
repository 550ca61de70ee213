"""Affine-quantized weights (MLX's `mx.quantize` layout, 4 or 8 bits, groups of 32/64/128) times
a few rows of activations on CUDA, through our own kernel (built once per machine:
model/kernels/cuda_build.py): the dense product
`x @ dequantize(w).T` and the routed-experts product (`gather_qmm` over rows sorted by expert).

MLX's CUDA `quantized_matmul` is a one-row kernel; for more rows it dequantizes the weights and
runs a GEMM. Here a product of up to 64 rows reads the packed weights once, at full bandwidth:

* A warp owns 16 weight rows (output columns). Each lane streams 16 bytes of each of two rows per
  iteration (4-bit: 32 values, 8-bit: 16), dequantizes them in registers (`w = scale * q + bias`
  rounded once to the activation type) and feeds them to `mma.sync` m16n8k16 as the A operand;
  the activations are the B operand, 8 rows per tile, staged in shared memory by `cp.async`
  (double-buffered, bank-conflict-free by a padded and swizzled layout). Products accumulate in
  float32.
* Within each 16-wide k step of the mma, a lane's four k positions are a permutation of the k
  values it loaded (4-bit: the pairs the nibble mask gives, (e0, e4), (e1, e5) ...; 8-bit: the
  natural order); the activations are read through the same permutation, so the sum is the same.
* K is split over the block's warps (`WK`) and, on sm_90, over a thread-block cluster (`S`
  blocks, reduced through distributed shared memory). Each output's partial sums are added in a
  fixed order, and every row of x meets the same k order whatever the other rows are, so a row's
  result does not depend on its batch for a given configuration; the configuration depends only
  on the weight shape (`config_for`).
* Experts: the pairs are sorted by expert; one block column per expert finds its run of pairs
  (binary search) and multiplies those rows by that expert's weights, so each used expert's
  weights are read once per step.

Where MLX's own op is kept: one row (a B=1 decode step is mlx-lm's exact product, so greedy
outputs stay mlx-lm's), more than `MAX_ROWS` rows (prefill), shapes that do not tile, and any
device but a CUDA GPU. `model/quant_linear.py` routes the model's quantized linears here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import mlx.core as mx

from model.kernels import cuda_build
from model.kernels.qmm_cuda import BODY, HEADER

MAX_ROWS = 64
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)
WARPS = 8
_THREADS = 32 * WARPS

# Set False (benchmarks only) to measure MLX's own ops on the same process.
ENABLED = True


@attrs.frozen
class Config:
    """How one weight shape is tiled: WN warps along the output columns x WK along K per block,
    S blocks of a cluster along K, U weight loads in flight per lane."""

    wn: int
    wk: int
    s: int = 1
    u: int = 2

    def k_step(self, bits: int) -> int:
        """K must be a multiple of this: every block's share in whole block iterations."""
        return (128 if bits == 4 else 64) * self.wk * self.s


def _shared_bytes(cfg: Config, bits: int, maxnt: int, itemsize: int) -> int:
    ck = 128 if bits == 4 else 64
    row = ck * cfg.wk + (16 if bits == 4 else 8)
    xs = 2 * maxnt * 8 * row * itemsize
    red = (cfg.wk * cfg.wn * maxnt * 128 + cfg.wn * maxnt * 128) * 4 if (cfg.wk > 1 or cfg.s > 1) else 0
    return max(xs, red)


def _maxnt(rows: int) -> int:
    """The kernel's n-tile capacity for `rows` activations (compiled per bucket)."""
    for cap in (1, 2, 4, 8):
        if rows <= 8 * cap:
            return cap
    raise ValueError(f"{rows} rows: more than {MAX_ROWS}")


_kernels: dict[tuple[Any, ...], Any] = {}


def _kernel_name(dtype: mx.Dtype, bits: int, maxnt: int, cfg: Config, gather: bool) -> str:
    t = "bf16" if dtype == mx.bfloat16 else "f16"
    return f"qmm_{'gather_' if gather else ''}{t}_b{bits}_nt{maxnt}_wn{cfg.wn}_wk{cfg.wk}_s{cfg.s}_u{cfg.u}"


def _source(dtype: mx.Dtype, bits: int, maxnt: int, cfg: Config, gather: bool) -> tuple[str, str]:
    """(header, body) of one configuration: every constant baked in, so the kernel name is exact
    (MLX adds nothing without template arguments) and a cluster launch can be declared on it."""
    name = "custom_kernel_" + _kernel_name(dtype, bits, maxnt, cfg, gather)
    header = HEADER
    header += f"\n#define QMM_GATHER {1 if gather else 0}\n"
    if cfg.s > 1:
        # The kernel is declared `__global__ void <name>(`: the macro puts the cluster shape on it; the body
        # undefines it so NVRTC's own reference to the kernel by name reads plainly.
        header += f"\n#define QMM_CLUSTER 1\n#define {name} __cluster_dims__({cfg.s}, 1, 1) {name}\n"
    else:
        header += "\n#define QMM_CLUSTER 0\n"
    consts = (
        f"#undef {name}\n"
        f"    using T = {'__nv_bfloat16' if dtype == mx.bfloat16 else '__half'};\n"
        f"    constexpr int BITS = {bits};\n"
        f"    constexpr int MAXNT = {maxnt};\n"
        f"    constexpr int WN = {cfg.wn};\n"
        f"    constexpr int WK = {cfg.wk};\n"
        f"    constexpr int S = {cfg.s};\n"
        f"    constexpr int U = {cfg.u};\n"
    )
    return header, consts + BODY


def _kernel(dtype: mx.Dtype, bits: int, maxnt: int, cfg: Config, gather: bool) -> Any:
    key = (dtype, bits, maxnt, cfg, gather)
    if key not in _kernels:
        header, body = _source(dtype, bits, maxnt, cfg, gather)
        inputs = ["x", "w", "scales", "biases"] + (["idx", "rowmap"] if gather else [])
        _kernels[key] = cuda_build.kernel(
            name=_kernel_name(dtype, bits, maxnt, cfg, gather),
            input_names=inputs,
            output_names=["y"],
            source=body,
            header=header,
            shared_memory=_shared_bytes(cfg, bits, maxnt, 2),
        )
    return _kernels[key]


def available() -> bool:
    """Whether the kernels can run: the default device is a CUDA GPU."""
    return ENABLED and mx.cuda.is_available() and mx.default_device().type == mx.gpu


_clusters: bool | None = None


def clusters() -> bool:
    """Whether thread-block clusters exist here (sm_90 and later)."""
    global _clusters
    if _clusters is None:
        try:
            arch = str(mx.device_info().get("architecture", ""))
            digits = "".join(ch for ch in arch if ch.isdigit())
            _clusters = bool(digits) and int(digits[:2] if len(digits) >= 2 else digits) >= 90
        except Exception:  # noqa: BLE001 - unknown device: no clusters
            _clusters = False
    return _clusters


def _candidates(n: int, k: int, bits: int) -> list[Config]:
    """Tilings that fit the shape: N in whole 16-column warp tiles, K in whole block iterations."""
    out = []
    for wn, wk in ((8, 1), (4, 2), (2, 4)):
        for s in (1, 2, 4, 8) if clusters() else (1,):
            cfg = Config(wn, wk, s)
            if n % 16 == 0 and k % cfg.k_step(bits) == 0:
                out.append(cfg)
    return out


# Enough blocks to cover the GPU about twice (H100: 132 SMs).
_TARGET_BLOCKS = 256


def config_for(n: int, k: int, bits: int) -> Config | None:
    """The tiling for a weight shape: the widest block tile (fewest re-reads of x) that still
    gives about `_TARGET_BLOCKS` blocks, splitting K over warps, then over a cluster, where the
    columns alone give too few. A tuned choice (`tune`) overrides it. None: the shape does not tile."""
    tuned = _tuned.get((n, k, bits))
    if tuned is not None:
        return tuned
    cands = _candidates(n, k, bits)
    if not cands:
        return None

    def score(cfg: Config) -> tuple[int, int, int]:
        blocks = -(-n // (16 * cfg.wn)) * cfg.s
        enough = blocks >= _TARGET_BLOCKS
        # enough blocks first; then the widest tile; then the fewest splits
        return (0 if enough else 1, -cfg.wn if enough else -blocks, cfg.s * cfg.wk)

    return min(cands, key=score)


_tuned: dict[tuple[int, int, int], Config] = {}
# (n, k, bits, group size, dtype name) -> [(rows, kernel faster)], measured by `tune`.
_verdicts: dict[tuple[int, int, int, int, str], list[tuple[int, bool]]] = {}


# (experts, n, k, bits, group size, dtype name) -> [(tokens, kernel faster)], by `tune_gather`.
_gather_verdicts: dict[tuple[int, int, int, int, int, str], list[tuple[int, bool]]] = {}


def _verdict(measured: Iterable[tuple[int, bool]], rows: int) -> bool:
    """The verdict of the nearest measured row count at or above `rows` (none measured: yes;
    above every measured one: the largest's)."""
    last = True
    for count, faster in measured:
        if count >= rows:
            return faster
        last = faster
    return last


def wins(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, rows: int) -> bool:
    """Whether the kernel beat MLX's op for this shape at `rows` (model/quant_tune.py measured)."""
    return _verdict(_verdicts.get((n, k, bits, group_size, str(dtype)), ()), rows)


def _supported(dtype: mx.Dtype, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, gs: int) -> bool:
    return (
        bits in BITS
        and gs in GROUP_SIZES
        and biases is not None
        and dtype in DTYPES
        and scales.dtype == dtype
        and biases.dtype == dtype
        and w.dtype == mx.uint32
    )


def rows_of(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


def usable(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group_size: int) -> bool:
    """Whether `x @ dequantize(w).T` can take the kernel here: a CUDA GPU, 2..MAX_ROWS rows of a
    supported dtype, a weight shape that tiles, and a row count where it won (model/quant_tune.py)."""
    if not available() or w.ndim != 2 or not _supported(x.dtype, w, scales, biases, bits, group_size):
        return False
    rows = rows_of(x)
    if not 2 <= rows <= MAX_ROWS:
        return False
    n, k = w.shape[0], x.shape[-1]
    if w.shape[1] * 32 // bits != k or config_for(n, k, bits) is None:
        return False
    return wins(n, k, bits, group_size, x.dtype, rows)


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, cfg: Config | None = None) -> mx.array:
    """`x @ dequantize(w, scales, biases).T` for `usable` operands ([..., K] -> [..., N])."""
    k = x.shape[-1]
    n = w.shape[0]
    rows = rows_of(x)
    cfg = cfg or config_for(n, k, bits)
    assert cfg is not None
    maxnt = _maxnt(rows)
    tiles = -(-n // (16 * cfg.wn))
    (y,) = _kernel(x.dtype, bits, maxnt, cfg, False)(
        inputs=[x.reshape(rows, k), w, scales, biases],
        grid=(tiles * cfg.s * 32 * cfg.wn * cfg.wk, 1, 1),
        threadgroup=(32 * cfg.wn * cfg.wk, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], n)


def gather_config_for(n: int, k: int, bits: int) -> Config | None:
    """The routed product's tiling: no cluster (the experts already give many blocks), K over two
    warps where it divides."""
    cands = [c for c in _candidates(n, k, bits) if c.s == 1]
    order = {(4, 2): 0, (8, 1): 1, (2, 4): 2}
    return min(cands, key=lambda c: order.get((c.wn, c.wk), 9)) if cands else None


def gather_usable(
    dtype: mx.Dtype, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group_size: int, tokens: int
) -> bool:
    """Whether a routed-experts product of `dtype` activations over `tokens` rows can take the
    kernel (2..MAX_ROWS rows)."""
    if not available() or w.ndim != 3 or not _supported(dtype, w, scales, biases, bits, group_size):
        return False
    if not 2 <= tokens <= MAX_ROWS:
        return False
    e, n, k = w.shape[0], w.shape[1], w.shape[2] * 32 // bits
    if gather_config_for(n, k, bits) is None:
        return False
    return _verdict(_gather_verdicts.get((e, n, k, bits, group_size, str(dtype)), ()), tokens)


def gather_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    rowmap: mx.array,
    experts: mx.array,
    bits: int,
    cfg: Config | None = None,
    rows_per_expert: int = 16,
) -> mx.array:
    """out[p] = x[rowmap[p]] @ dequantize(w[experts[p]]).T for pairs sorted by expert
    (`experts` non-decreasing, uint32/int32 [P]); x [R, K] -> [P, N]. `rows_per_expert`: the
    rows a block holds at once (an expert with more runs them in turns)."""
    k = x.shape[-1]
    experts_n, n = w.shape[0], w.shape[1]
    pairs = experts.size
    cfg = cfg or gather_config_for(n, k, bits)
    assert cfg is not None
    maxnt = _maxnt(min(rows_per_expert, MAX_ROWS))
    tiles = -(-n // (16 * cfg.wn))
    (y,) = _kernel(x.dtype, bits, maxnt, cfg, True)(
        inputs=[x.reshape(-1, k), w, scales, biases, experts.astype(mx.uint32), rowmap.astype(mx.uint32)],
        grid=(tiles * cfg.s * 32 * cfg.wn * cfg.wk, experts_n, 1),
        threadgroup=(32 * cfg.wn * cfg.wk, 1, 1),
        output_shapes=[(pairs, n)],
        output_dtypes=[x.dtype],
    )
    return y

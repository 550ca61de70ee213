"""Routed experts: mlx-lm's SwitchGLU and the Qwen3-MoE / Qwen3-Next sparse blocks, op for op.

Expert weights are stacked per projection, [experts, out, in] (`mlp.switch_mlp.gate_proj.weight`),
and each token multiplies only by its top-k experts through `mx.gather_mm` (`mx.gather_qmm` once
quantized: mlx-community's QuantizedSwitchLinear layout, weight/scales/biases with a leading
experts axis). The op sequence is mlx-lm's (models/switch_layers.py, models/qwen3_moe.py), so
greedy tokens match `mlx_lm.generate` on the same weights.

Every token is routed on its own: nothing in the block reads another row's data, so a batched
row computes what it computes alone (the gather products are one token's row each).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from model import prefill_dequant, quant_kernel
from model.nn.decoder import swiglu

# From this many (token, expert) pairs on, tokens are sorted by expert first, so each expert's
# weights are read once in a run (mlx-lm's threshold: the same choice keeps the same kernels).
SORT_MIN_PAIRS = 64


def _gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    *_, k = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // k], flat[order], inv_order


def _scatter_unsort(x: mx.array, inv_order: mx.array, shape: tuple[int, ...]) -> mx.array:
    return mx.unflatten(x[inv_order], 0, shape)


class QuantizedSwitchLinear(nn.Module):
    """Stacked expert weights, quantized per expert (mlx.core.quantize over the last axis)."""

    def __init__(
        self,
        weight: mx.array,
        bias: mx.array | None,
        group_size: int,
        bits: int,
        mode: str = "affine",
    ) -> None:
        super().__init__()
        self.group_size = group_size
        self.bits = bits
        self.mode = mode
        # Lazy: only the shapes are needed before the checkpoint's arrays replace these.
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        if bias is not None:
            self.bias = bias
        self.freeze()

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def __call__(
        self, x: mx.array, indices: mx.array, sorted_indices: bool = False, dequantized: bool = False
    ) -> mx.array:
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        gs, bits, mode = self.group_size, self.bits, self.mode
        if dequantized:  # a batch's prefill, where measured faster (model/prefill_dequant.py)
            x = prefill_dequant.expert_product(
                x, w, scales, biases, indices, group_size=gs, bits=bits, mode=mode, sorted_indices=sorted_indices
            )
        else:
            x = mx.gather_qmm(
                x, w, scales, biases, rhs_indices=indices, transpose=True, group_size=gs, bits=bits, mode=mode,
                sorted_indices=sorted_indices,
            )  # fmt: skip
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x


class SwitchLinear(nn.Module):
    """One Linear per expert, stacked: weight [experts, out, in]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(low=-scale, high=scale, shape=(num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def __call__(
        self, x: mx.array, indices: mx.array, sorted_indices: bool = False, dequantized: bool = False
    ) -> mx.array:
        # (`dequantized`: QuantizedSwitchLinear's choice; these weights are already dense)
        x = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedSwitchLinear:
        """What `nn.quantize` calls (model/load/weights.py decides which modules from the checkpoint)."""
        return QuantizedSwitchLinear(self.weight, self.get("bias"), group_size, bits, mode)


class SwitchGLU(nn.Module):
    """The SwiGLU MLP of each token's chosen experts: [..., D], [..., k] -> [..., k, D]."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        routed = _kernel_experts(self, x, indices)
        if routed is not None:
            return routed
        deq = _dequantized_prefill(self, x)
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= SORT_MIN_PAIRS
        idx = indices
        inv_order = None
        if do_sort:
            x, idx, inv_order = _gather_sort(x, indices)
        x_up = self.up_proj(x, idx, sorted_indices=do_sort, dequantized=deq)
        x_gate = self.gate_proj(x, idx, sorted_indices=do_sort, dequantized=deq)
        x = self.down_proj(swiglu(x_gate, x_up), idx, sorted_indices=do_sort, dequantized=deq)
        if inv_order is not None:
            x = _scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)


def expert_shape(p: Any, dtype: Any) -> prefill_dequant.Shape:
    """(experts, N, K, bits, group size, dtype) of a quantized expert stack."""
    e, n, packed = p["weight"].shape
    return (e, n, packed * 32 // p.bits, p.bits, p.group_size, dtype)


def _dequantized_prefill(glu: SwitchGLU, x: mx.array) -> bool:
    """Whether these tokens' expert products dequantize the experts (model/prefill_dequant.py): a
    batch's prefill (several sequences: one sequence's keeps mlx-lm's ops) of affine-quantized
    experts, as many tokens as the load-time measurement found faster that way."""
    if not prefill_dequant.batch_prefill(x):
        return False
    projs = (glu.up_proj, glu.gate_proj, glu.down_proj)
    if not all(type(p) is QuantizedSwitchLinear and p.mode == "affine" for p in projs):
        return False
    tokens = x.size // x.shape[-1]
    return all(prefill_dequant.wins(expert_shape(p, x.dtype), tokens) for p in projs)


def _kernel_experts(glu: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array | None:
    """SwitchGLU on the CUDA kernel (model/quant_kernel.py): every (token, expert) pair sorted by
    expert, each used expert's weights read once for all its rows. None where MLX's gather_qmm
    runs: not CUDA, one token (a B=1 decode step keeps mlx-lm's ops), one sequence of several
    tokens (a solo prefill), more than quant_kernel.MAX_ROWS tokens, or weights it does not take."""
    projs = (glu.up_proj, glu.gate_proj, glu.down_proj)
    if not all(type(p) is QuantizedSwitchLinear and p.mode == "affine" and "bias" not in p for p in projs):
        return None
    dims = x.shape[-1]
    tokens = x.size // dims
    if x.ndim >= 3 and x.shape[0] == 1 and x.shape[-2] > 1:
        return None
    for p in projs:
        if not quant_kernel.gather_usable(
            x.dtype, p["weight"], p["scales"], p.get("biases"), p.bits, p.group_size, tokens
        ):
            return None
    up, gate, down = projs
    if (
        down["weight"].shape[2] * 32 // down.bits != up["weight"].shape[1]
        or up["weight"].shape[2] * 32 // up.bits != dims
    ):
        return None
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    experts = flat[order].astype(mx.uint32)
    rowmap = (order // k).astype(mx.uint32)
    rows = min(tokens, 16)  # an expert's rows at once: a step's tokens rarely meet one expert more

    def product(p: Any, inputs: mx.array, which_rows: mx.array) -> mx.array:
        return quant_kernel.gather_qmm(
            inputs, p["weight"], p["scales"], p["biases"], which_rows, experts, p.bits, rows_per_expert=rows
        )

    x2 = x.reshape(tokens, dims)
    h = swiglu(product(gate, x2, rowmap), product(up, x2, rowmap))
    out = product(down, h, mx.arange(flat.size, dtype=mx.uint32))
    return out[mx.argsort(order)].reshape(*indices.shape, dims)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MLP: a softmax router picks each token's top-k experts, whose outputs are
    summed weighted by their router probabilities (renormalized over the k when `norm_topk_prob`)."""

    def __init__(self, dim: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(dim, intermediate_size, num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        y = self.switch_mlp(x, inds)
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3-Next's and Qwen3.5-MoE's MLP: the routed experts plus a dense shared expert whose
    output each token scales by a sigmoid gate of its own (mlx-lm's Qwen3NextSparseMoeBlock)."""

    def __init__(
        self, dim: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool, shared: nn.Module
    ) -> None:
        super().__init__(dim, intermediate_size, num_experts, top_k, norm_topk_prob)
        self.shared_expert = shared
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def unfuse_experts(weights: dict[str, mx.array]) -> None:
    """Transformers' fused expert tensors (`{prefix}.experts.gate_up_proj` [experts, 2 * inter, in]
    and `{prefix}.experts.down_proj`) split in place into the stacked switch_mlp weights, as
    mlx-lm's qwen3_5_moe sanitize does. A missing down_proj raises KeyError naming it."""
    for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
        prefix = key.removesuffix(".experts.gate_up_proj")
        gate_up = weights.pop(key)
        mid = gate_up.shape[-2] // 2
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")


def stack_experts(weights: dict[str, mx.array], prefix: str, num_experts: int) -> None:
    """Hugging Face's per-expert tensors (`{prefix}.experts.{e}.gate_proj.weight`) stacked in place
    into `{prefix}.switch_mlp.gate_proj.weight` [experts, out, in], as mlx-lm's sanitize does.
    A checkpoint missing some expert's tensor raises KeyError naming it."""
    for proj in ("up_proj", "down_proj", "gate_proj"):
        for part in ("weight", "scales", "biases", "bias"):
            first = f"{prefix}.experts.0.{proj}.{part}"
            if first not in weights:
                continue
            names = [f"{prefix}.experts.{e}.{proj}.{part}" for e in range(num_experts)]
            missing = [n for n in names if n not in weights]
            if missing:
                raise KeyError(f"{missing[0]} (and {len(missing) - 1} more expert tensors) missing")
            weights[f"{prefix}.switch_mlp.{proj}.{part}"] = mx.stack([weights.pop(n) for n in names])


def expert_prefixes(weights: dict[str, Any]) -> list[str]:
    """The `model.layers.N.mlp` prefixes that hold per-expert tensors."""
    found = {k.split(".experts.")[0] for k in weights if ".mlp.experts.0." in k}
    return sorted(found)

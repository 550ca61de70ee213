"""The gated delta net: Qwen3.5's linear-attention layer, op for op as mlx-lm's (its pure-MLX ops
path, which mlx-lm itself takes off Metal), so greedy tokens equal mlx_lm.generate's.

Per token: a causal depthwise convolution over the q/k/v projections (its last kernel-1 inputs are
state), L2-normalized q and k, then the delta rule on a per-head [Dv, Dk] matrix decayed by a
learned gate. The state lives in a `StateCache` / `BatchStateCache` (model/kv/state.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.kv.state import StateCache


@attrs.frozen
class DeltaArgs:
    hidden_size: int
    num_v_heads: int
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    rms_norm_eps: float


@partial(mx.compile, shapeless=True)
def compute_g(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


def normalize_qk(q: mx.array, k: mx.array, *, inv_scale: float, eps: float) -> tuple[mx.array, mx.array]:
    """L2-normalized q and k, the readout scale folded into q (rms_norm adds eps to the mean)."""
    rms_eps = eps * inv_scale**2
    return (inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps), inv_scale * mx.fast.rms_norm(k, None, rms_eps)


@mx.compile
def _step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dv, Dk]."""
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """The recurrence over T tokens: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv] -> y [B, T, Hv, Dv]
    and the state after the last token."""
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys = []
    for t in range(T):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


@partial(mx.compile, shapeless=True)
def _precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    return (nn.silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(h.dtype)


class RMSNormGated(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, hidden: mx.array, gate: mx.array) -> mx.array:
        return _precise_swiglu(hidden, gate, mx.fast.rms_norm(hidden, self.weight, self.eps))


class GatedDeltaNet(nn.Module):
    def __init__(self, args: DeltaArgs):
        super().__init__()
        if args.num_v_heads % args.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({args.num_v_heads}) must be a multiple of the key heads")
        self.args = args
        self.key_dim = args.head_k_dim * args.num_k_heads
        self.value_dim = args.head_v_dim * args.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, args.conv_kernel, groups=self.conv_dim, padding=0, bias=False
        )
        self.make_projections()
        self.dt_bias = mx.ones(args.num_v_heads)
        self.A_log = mx.zeros(args.num_v_heads)
        self.norm = RMSNormGated(args.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    # The input projections: Qwen3.5's four; Qwen3-Next fuses them (model/families/qwen3_next.py).
    def make_projections(self) -> None:
        dim, heads = self.args.hidden_size, self.args.num_v_heads
        self.in_proj_qkv = nn.Linear(dim, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, heads, bias=False)
        self.in_proj_a = nn.Linear(dim, heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x [B, S, D] -> the convolution's input [B, S, conv_dim], z [B, S, Hv, Dv], b and a [B, S, Hv]."""
        B, S, _ = x.shape
        z = self.in_proj_z(x).reshape(B, S, self.args.num_v_heads, self.args.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        cache.before_forward(self._replay, x)  # (a group prefill keeps its input: StateCache.row)
        return self.forward(x, cache)

    def _replay(self, x: mx.array, cache: StateCache) -> None:
        self.forward(x, cache)

    def forward(self, x: mx.array, cache: Any) -> mx.array:
        a_ = self.args
        B, S, _ = x.shape
        qkv, z, b, a = self.project(x)
        conv_state = cache.conv
        if conv_state is None:
            conv_state = mx.zeros((B, a_.conv_kernel - 1, self.conv_dim), dtype=x.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        new_conv = mx.contiguous(conv_input[:, -(a_.conv_kernel - 1) :, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = (
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [a_.num_k_heads, a_.num_k_heads, a_.num_v_heads],
                [a_.head_k_dim, a_.head_k_dim, a_.head_v_dim],
            )
        )
        q, k = normalize_qk(q, k, inv_scale=a_.head_k_dim**-0.5, eps=1e-6)
        out, state = gated_delta_update(q, k, v, a, b, self.A_log, self.dt_bias, cache.recurrent)
        cache.update(new_conv, state, S)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))

    def state_bytes(self, dtype_bytes: int) -> int:
        """One row's state: the convolution tail and the float32 recurrent matrices."""
        a = self.args
        return (a.conv_kernel - 1) * self.conv_dim * dtype_bytes + a.num_v_heads * a.head_v_dim * a.head_k_dim * 4

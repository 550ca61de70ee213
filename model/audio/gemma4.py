"""Gemma 4's audio tower (E2B, E4B): log-mel frames (model/audio/features.py) to soft tokens.

A conformer after the Universal Speech Model: two stride-2 convolutions (LayerNorm, ReLU) fold
four 10 ms frames into one 40 ms step; each block is a half-step feed-forward, chunked local
self-attention (chunks of 12 steps seeing 12 back, relative positions, soft-capped logits), a
light depthwise causal convolution, another half feed-forward, an RMSNorm; an output projection.
Linears clamp their inputs and outputs to bounds the checkpoint stores.

Op for op as mlx-vlm's gemma4 audio module (features equal its on the same weights); parameter
names follow the checkpoint's `audio_tower.*`.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from model.vision.gemma4 import ClippableLinear

MEL_BINS = 128


@attrs.frozen
class AudioArgs:
    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1e9
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int | None = 1536

    @classmethod
    def from_config(cls, c: dict[str, Any]) -> AudioArgs:
        d = cls()
        names = {f.name for f in attrs.fields(cls)}
        given = {k: v for k, v in c.items() if k in names}
        if "subsampling_conv_channels" in given:
            given["subsampling_conv_channels"] = tuple(int(x) for x in given["subsampling_conv_channels"])
        return attrs.evolve(d, **given)

    @property
    def output_dims(self) -> int:
        return self.output_proj_dims or self.hidden_size

    @property
    def past(self) -> int:
        return max(0, self.attention_context_left - 1)

    @property
    def context(self) -> int:
        return self.attention_chunk_size + self.past + self.attention_context_right


class ConvBlock(nn.Module):
    """Conv2d (3x3, stride 2, zero-padded by 1) over (time, mel), LayerNorm over channels, ReLU."""

    def __init__(self, a: AudioArgs, i: int):
        super().__init__()
        channels = a.subsampling_conv_channels
        self.conv = nn.Conv2d(
            1 if i == 0 else channels[i - 1], channels[i], kernel_size=(3, 3), stride=(2, 2), bias=False
        )
        self.norm = nn.LayerNorm(channels[i], eps=a.rms_norm_eps, bias=False)

    def __call__(self, x: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x = mx.where(mask[:, :, None, None], 0.0, x)
        x = self.conv(mx.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)]))
        return nn.relu(self.norm(x)), mask[:, ::2][:, : x.shape[1]]


class Subsample(nn.Module):
    def __init__(self, a: AudioArgs):
        super().__init__()
        self.layer0, self.layer1 = ConvBlock(a, 0), ConvBlock(a, 1)
        freq = MEL_BINS
        for _ in range(2):
            freq = (freq + 2 - 3) // 2 + 1
        self.input_proj_linear = nn.Linear(freq * a.subsampling_conv_channels[-1], a.hidden_size, bias=False)

    def __call__(self, mel: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        x, mask = self.layer0(mx.expand_dims(mel, -1), mask)
        x, mask = self.layer1(x, mask)
        B, T, F, C = x.shape
        return self.input_proj_linear(x.reshape(B, T, F * C)), mask


class FeedForward(nn.Module):
    def __init__(self, a: AudioArgs):
        super().__init__()
        self.a = a
        self.pre_layer_norm = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.ffw_layer_1 = ClippableLinear(a.hidden_size, a.hidden_size * 4)
        self.ffw_layer_2 = ClippableLinear(a.hidden_size * 4, a.hidden_size)
        self.post_layer_norm = nn.RMSNorm(a.hidden_size, eps=1e-6)

    def __call__(self, x: mx.array) -> mx.array:
        clip = self.a.gradient_clipping
        h = self.ffw_layer_1(self.pre_layer_norm(mx.clip(x, -clip, clip)))
        h = self.post_layer_norm(mx.clip(self.ffw_layer_2(nn.silu(h)), -clip, clip))
        return x + h * self.a.residual_weight


class Attention(nn.Module):
    def __init__(self, a: AudioArgs):
        super().__init__()
        self.a = a
        d, self.heads = a.hidden_size, a.num_attention_heads
        self.head_dim = d // self.heads
        self.relative_k_proj = nn.Linear(d, d, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_proj, self.k_proj, self.v_proj = ClippableLinear(d, d), ClippableLinear(d, d), ClippableLinear(d, d)
        self.post = ClippableLinear(d, d)
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        scales = d // 2
        increment = math.log(10000.0) / max(scales - 1, 1)
        self._inv_timescales = (mx.exp(mx.arange(scales) * -increment)).reshape(1, 1, scales)

    def _blocks(self, x: mx.array) -> mx.array:
        """[B, T, ...] -> [B, chunks, chunk, ...] (zero-padded at the end)."""
        chunk = self.a.attention_chunk_size
        n = -(-x.shape[1] // chunk)
        x = _pad_time(x, 0, n * chunk - x.shape[1])
        return x.reshape(x.shape[0], n, chunk, *x.shape[2:])

    def _context(self, x: mx.array) -> mx.array:
        """[B, T, ...] -> [B, chunks, context, ...]: each chunk with its past (and future) steps."""
        a = self.a
        x = _pad_time(x, a.past, a.attention_context_right + a.attention_chunk_size - 1)
        n = (x.shape[1] - a.context) // a.attention_chunk_size + 1
        index = (mx.arange(n) * a.attention_chunk_size)[:, None] + mx.arange(a.context)[None, :]
        return x[:, index]

    def _relative(self, q: mx.array, k: mx.array) -> mx.array:
        B, U, W, N, H = q.shape
        C = k.shape[2]
        positions = mx.arange(self.a.past, -self.a.attention_context_right - 1, -1)[None]
        span = positions.shape[1]
        scaled = positions.astype(mx.float32)[..., None] * self._inv_timescales
        signal = mx.concatenate([mx.sin(scaled), mx.cos(scaled)], axis=-1).astype(q.dtype)
        emb = self.relative_k_proj(signal.astype(self.relative_k_proj.weight.dtype))
        emb = emb.reshape(span, N, H).astype(q.dtype)
        qp = q.transpose(0, 3, 1, 2, 4)
        term_ac = qp @ k.transpose(0, 3, 1, 4, 2)
        term_bd = (qp.reshape(B, N, U * W, H) @ emb.transpose(1, 2, 0)).reshape(B, N, U, W, span)
        term_bd = mx.pad(term_bd, [(0, 0), (0, 0), (0, 0), (0, 0), (0, C + 1 - span)])
        term_bd = term_bd.reshape(B, N, U, W * (C + 1))[:, :, :, : W * C].reshape(B, N, U, W, C)
        return term_ac + term_bd

    def __call__(self, x: mx.array, mask: mx.array, local: mx.array) -> mx.array:
        a = self.a
        B, T = x.shape[:2]
        shape = (B, T, self.heads, self.head_dim)
        q = self.q_proj(x).astype(mx.float32).reshape(shape)
        k = self.k_proj(x).astype(mx.float32).reshape(shape)
        v = self.v_proj(x).astype(mx.float32).reshape(shape)
        q = q * (self.q_scale * nn.softplus(self.per_dim_scale))
        k = k * self.k_scale
        valid = self._context(~mask)[:, None, :, None, :] & local[None, None, None, :, :]
        logits = self._relative(self._blocks(q), self._context(k))
        logits = mx.tanh(logits / a.attention_logit_cap) * a.attention_logit_cap
        logits = mx.where(valid, logits, a.attention_invalid_logits_value)
        context = mx.einsum("bnuwc,bucnh->buwnh", mx.softmax(logits, axis=-1), self._context(v))
        U = context.shape[1]
        context = context.reshape(B, U * a.attention_chunk_size, self.heads, self.head_dim)[:, :T]
        return self.post(context.reshape(B, T, -1))


class LightConv(nn.Module):
    def __init__(self, a: AudioArgs):
        super().__init__()
        self.a = a
        d = a.hidden_size
        self.pre_layer_norm = nn.RMSNorm(d, eps=a.rms_norm_eps)
        self.linear_start = ClippableLinear(d, d * 2)
        self.depthwise_conv1d = nn.Conv1d(d, d, kernel_size=a.conv_kernel_size, bias=False)
        self.depthwise_conv1d.weight = mx.zeros((d, a.conv_kernel_size, 1))
        self.conv_norm = nn.RMSNorm(d, eps=a.rms_norm_eps)
        self.linear_end = ClippableLinear(d, d)

    def __call__(self, x: mx.array) -> mx.array:
        clip = self.a.gradient_clipping
        h1, h2 = mx.split(self.linear_start(self.pre_layer_norm(x)), 2, axis=-1)
        h = mx.pad(h1 * mx.sigmoid(h2), [(0, 0), (self.a.conv_kernel_size - 1, 0), (0, 0)])
        h = mx.conv_general(h, self.depthwise_conv1d.weight, stride=1, padding=0, groups=h.shape[-1])
        return self.linear_end(nn.silu(self.conv_norm(mx.clip(h, -clip, clip)))) + x


class Block(nn.Module):
    def __init__(self, a: AudioArgs):
        super().__init__()
        self.a = a
        self.feed_forward1 = FeedForward(a)
        self.self_attn = Attention(a)
        self.lconv1d = LightConv(a)
        self.feed_forward2 = FeedForward(a)
        self.norm_pre_attn = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.norm_post_attn = nn.RMSNorm(a.hidden_size, eps=1e-6)
        self.norm_out = nn.RMSNorm(a.hidden_size, eps=1e-6)

    def __call__(self, x: mx.array, mask: mx.array, local: mx.array) -> mx.array:
        clip = self.a.gradient_clipping
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(mx.clip(x, -clip, clip)), mask, local)
        x = x + self.norm_post_attn(mx.clip(h, -clip, clip))
        x = self.lconv1d(x * (~mask)[:, :, None].astype(x.dtype))
        return self.norm_out(mx.clip(self.feed_forward2(x), -clip, clip))


class AudioTower(nn.Module):
    """`(encoded, mask) = tower(mel, mask)`: [B, frames, 128] log-mel frames (mask: padding) ->
    [B, frames / 4, output dims] soft tokens, padded steps zeroed."""

    def __init__(self, a: AudioArgs):
        super().__init__()
        self.args = a
        self.subsample_conv_projection = Subsample(a)
        self.layers = [Block(a) for _ in range(a.num_hidden_layers)]
        if a.output_proj_dims is not None:
            self.output_proj = nn.Linear(a.hidden_size, a.output_proj_dims, bias=True)

    def __call__(self, mel: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        x, mask = self.subsample_conv_projection(mel, mask)
        distance = mx.arange(a.attention_chunk_size)[:, None] + a.past - mx.arange(a.context)[None, :]
        future = (distance < 0) & (-distance < a.attention_context_right)
        local = ((distance >= 0) & (distance < a.past)) | future
        for layer in self.layers:
            x = layer(x, mask, local)
        if a.output_proj_dims is not None:
            x = self.output_proj(x)
        mask = mask[:, : x.shape[1]]
        return mx.where(mask[:, :, None], 0.0, x), mask

    def sanitize(self, weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
        """PyTorch's conv layouts as MLX's: Conv2d [out, in, kH, kW] -> [out, kH, kW, in],
        depthwise Conv1d [out, 1, k] -> [out, k, 1] (a converted checkpoint's stay)."""
        channels = self.args.subsampling_conv_channels
        out = dict(weights)
        for key, value in weights.items():
            if not key.startswith(prefix):
                continue
            if "subsample_conv_projection" in key and key.endswith("conv.weight") and value.ndim == 4:
                expected = 1 if ".layer0." in key else channels[0]
                if value.shape[-1] != expected:
                    out[key] = value.transpose(0, 2, 3, 1)
            elif key.endswith("depthwise_conv1d.weight") and value.ndim == 3 and value.shape[-1] != 1:
                out[key] = value.transpose(0, 2, 1)
        return out


def _pad_time(x: mx.array, before: int, after: int) -> mx.array:
    pads = [(0, 0)] * x.ndim
    pads[1] = (before, after)
    return mx.pad(x, pads)

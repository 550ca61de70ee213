"""The engine's device and shape choices, as one options object (built from CLI flags).

`None` means "the device's default", resolved by `EngineOptions.resolve()` on the MLX thread
(the engine does it once, at construction), where the device is known: the defaults differ
between CUDA (where every new kernel shape costs a graph build and fresh buffers are
first-touched managed memory) and CPU / Metal (where neither is true).
"""

from __future__ import annotations

import attrs

# Group prefill widths round up to a multiple of this on a GPU: MLX's CUDA attention builds a
# cuDNN graph for every new (rows, q, k) shape — about 66 ms on an H200 against 0.4 ms to run
# it — so arbitrary widths each paid that; rounded ones repeat.
GPU_GROUP_BUCKET = 64
# KV capacities warm-up meets on CUDA (each costs one throwaway B=1 decode forward; ~2.5 s of
# start-up for 256 ... 8192 on an H200): past it a long stream pays ~0.4 s per 256 tokens.
CUDA_WARM_DECODE_CAPACITY = 8192


@attrs.frozen
class EngineOptions:
    # Prompt tokens per prefill forward (a longer prompt takes several chunks).
    prefill_chunk: int = 2048
    # Right-pad a row's own prefill forwards to a multiple of this (0 = exact widths: a cold
    # prompt keeps mlx-lm's shapes, and so its greedy tokens, on CUDA too). The padding sits
    # after the real tokens, so causal attention keeps it out of their keys and values, and it
    # is trimmed off the caches: the same math, but on CUDA cuBLAS picks GEMM kernels by shape,
    # and on the 8B shape a padded prefill's greedy tokens left mlx-lm's at token 0.
    prefill_bucket: int = 0
    # The same for a group prefill's shared width. None: GPU_GROUP_BUCKET on a GPU, else 0.
    group_bucket: int | None = None
    # A prefill after a prompt-cache hit runs its attention as matmuls: MLX's own fallback formula,
    # which builds no per-shape cuDNN graph (a suffix after a hit has a new k length almost every
    # time). A cold prompt never takes it, so its tokens stay mlx-lm's. None: on under CUDA only.
    unfused_hit_prefill: bool | None = None
    # Warm-up meets KV buffers of every capacity up to this. None: CUDA_WARM_DECODE_CAPACITY on
    # CUDA, else 0.
    warm_decode_capacity: int | None = None
    # Release MLX's freed buffers after each prefill and every 256 steps, as mlx-lm does. None:
    # off on CUDA (fresh buffers there are first-touched managed memory), on elsewhere.
    clear_cache: bool | None = None
    # Decode steps run as compiled stages (same numerics, far fewer host ops); False runs the
    # eager graph (tests compare the two).
    compile_decode: bool = True

    def resolve(self, *, gpu: bool, cuda: bool) -> ResolvedOptions:
        """Every `None` replaced by the default for this device (`cuda` implies `gpu`)."""
        return ResolvedOptions(
            prefill_chunk=self.prefill_chunk,
            prefill_bucket=max(0, self.prefill_bucket),
            group_bucket=max(0, self.group_bucket if self.group_bucket is not None else GPU_GROUP_BUCKET if gpu else 0),
            unfused_hit_prefill=self.unfused_hit_prefill if self.unfused_hit_prefill is not None else cuda,
            warm_decode_capacity=(
                self.warm_decode_capacity
                if self.warm_decode_capacity is not None
                else (CUDA_WARM_DECODE_CAPACITY if cuda else 0)
            ),
            clear_cache=self.clear_cache if self.clear_cache is not None else not cuda,
            compile_decode=self.compile_decode,
        )


@attrs.frozen
class ResolvedOptions:
    """`EngineOptions` for one device: the same fields, none left to a default."""

    prefill_chunk: int
    prefill_bucket: int
    group_bucket: int
    unfused_hit_prefill: bool
    warm_decode_capacity: int
    clear_cache: bool
    compile_decode: bool


def padding(width: int, bucket: int) -> int:
    """Tokens to add after a forward of `width` to reach the next multiple of `bucket` (0 = exact)."""
    return -width % bucket if bucket else 0

"""The engine's options for one device: `resolve_engine` turns every auto (None) of an
`EngineOptions` into the device's default. It is the one place those defaults live; the engine
calls it when it is built, and the server's start-up resolution (actors/options.py) through it.

The defaults differ between CUDA (where every new kernel shape costs a graph build and fresh
buffers are first-touched managed memory) and CPU / Metal (where neither is true).
"""

from __future__ import annotations

import attrs

from model.options.groups import EngineOptions

# Group prefill widths round up to a multiple of this on a GPU: MLX's CUDA attention builds a
# cuDNN graph for every new (rows, q, k) shape — about 66 ms on an H200 against 0.4 ms to run
# it — so arbitrary widths each paid that; rounded ones repeat.
GPU_GROUP_BUCKET = 64
# KV capacities warm-up meets on CUDA (each costs one throwaway B=1 decode forward; ~2.5 s of
# start-up for 256 ... 8192 on an H200): past it a long stream pays ~0.4 s per 256 tokens.
CUDA_WARM_DECODE_CAPACITY = 8192


@attrs.frozen
class ResolvedEngine:
    """`EngineOptions` for one device: the fields the engine reads, none left to a default."""

    prefill_chunk: int
    prefill_bucket: int
    group_bucket: int
    unfused_hit_prefill: bool
    warm_decode_capacity: int
    clear_cache: bool
    compile_decode: bool


def resolve_engine(options: EngineOptions, *, gpu: bool, cuda: bool) -> ResolvedEngine:
    """Every auto of `options` replaced by the default for this device (`cuda` implies `gpu`)."""
    group_bucket = options.group_bucket if options.group_bucket is not None else GPU_GROUP_BUCKET if gpu else 0
    return ResolvedEngine(
        prefill_chunk=options.prefill_chunk,
        prefill_bucket=max(0, options.prefill_bucket),
        group_bucket=max(0, group_bucket),
        unfused_hit_prefill=options.unfused_hit_prefill if options.unfused_hit_prefill is not None else cuda,
        warm_decode_capacity=(
            options.warm_decode_capacity
            if options.warm_decode_capacity is not None
            else (CUDA_WARM_DECODE_CAPACITY if cuda else 0)
        ),
        clear_cache=options.clear_cache if options.clear_cache is not None else not cuda,
        compile_decode=options.compile_decode,
    )


def padding(width: int, bucket: int) -> int:
    """Tokens to add after a forward of `width` to reach the next multiple of `bucket` (0 = exact)."""
    return -width % bucket if bucket else 0

"""The command line's feature flag groups, registered on the server's parser in one call: the
engine's device and shape choices here, and each feature's own flags from its module."""

from __future__ import annotations

import argparse

from actors.adapter_flags import add_adapter_flags
from actors.flag_types import at_least_one, auto_on_off, non_negative_int
from actors.kv_flags import add_kv_flags
from actors.media_flags import add_media_flags
from actors.retention_flags import add_retention_flags
from actors.spec_flags import add_spec_flags
from actors.tp_flags import add_tensor_parallel_flags
from actors.trace_flags import add_trace_flags
from actors.ui_flags import add_ui_flags


def add_feature_flags(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    add_retention_flags(p)
    add_kv_flags(p)
    add_spec_flags(p)
    add_adapter_flags(p)
    add_ui_flags(p)
    add_trace_flags(p)
    add_tensor_parallel_flags(p)
    add_media_flags(p)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's shape and device choices (model/options.py); `auto` = the device's default."""
    p.add_argument(
        "--prefill-chunk",
        type=at_least_one,
        default=2048,
        metavar="N",
        help="prompt tokens per prefill forward; a longer prompt takes several (default 2048)",
    )
    p.add_argument(
        "--prefill-bucket",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="right-pad a request's prefill to a multiple of N tokens so CUDA attention graphs "
        "are reused (first prompt of a new length ~60 ms faster on an H200); greedy "
        "tokens may then differ from mlx-lm's in the last bits (default 0 = exact widths)",
    )
    p.add_argument(
        "--group-bucket",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="round a group prefill's shared width up to a multiple of N tokens, so its shapes "
        "recur (default: 64 on a GPU, where each new shape builds a cuDNN graph; 0 elsewhere)",
    )
    p.add_argument(
        "--unfused-hit-prefill",
        type=auto_on_off,
        default=None,
        metavar="auto|on|off",
        help="after a prompt-cache hit, run the prefill's attention as plain matmuls, which build "
        "no per-shape cuDNN graph; cold prompts never take it (default auto: on under CUDA)",
    )
    p.add_argument(
        "--warm-decode-capacity",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="warm-up also meets KV buffers of every capacity up to N tokens, each a first-use "
        "stall of ~0.4 s on CUDA (default: 8192 on CUDA, else 0)",
    )
    p.add_argument(
        "--clear-cache",
        type=auto_on_off,
        default=None,
        metavar="auto|on|off",
        help="release MLX's freed buffers after each prefill and every 256 steps, as mlx-lm does "
        "(default auto: off on CUDA, where reused buffers are faster; on elsewhere)",
    )

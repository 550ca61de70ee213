"""The KV-cache quantization flags (`--kv-quant`, `--kv-group-size`, `--quantized-kv-start`).

They fill `ServeConfig`'s fields of the same names; the worker turns them into a
`model.kv_scheme.KVScheme` once the model is loaded (a kv_config.json is only read then).
"""

from __future__ import annotations

import argparse

from model.kv_scheme import DEFAULT_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START

KV_QUANT_CHOICES = ("off", "config", "4", "8")
KV_GROUP_SIZES = (32, 64, 128)


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-quant",
        choices=KV_QUANT_CHOICES,
        default="off",
        help="store the KV cache quantized: 8 or 4 bits in every layer, config = the model's "
        "kv_config.json (full precision if it ships none), off = the activation dtype (default off)",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=DEFAULT_GROUP_SIZE,
        metavar="{32,64,128}",
        help=f"elements per quantization group along the head dimension (default {DEFAULT_GROUP_SIZE})",
    )
    p.add_argument(
        "--quantized-kv-start",
        type=_non_negative_int,
        default=DEFAULT_QUANTIZED_KV_START,
        metavar="N",
        help="a row's KV turns quantized after the first forward that leaves it holding at least N "
        f"positions (default {DEFAULT_QUANTIZED_KV_START}, as mlx-lm)",
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value

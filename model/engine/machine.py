"""What the device is and how fast it reads memory: GET /fit's machine facts.

Decode is bound by memory bandwidth (each step reads every weight and each row's KV once), so
/fit predicts decode speed from it. The bandwidth is measured rather than looked up by device
name: one elementwise pass over a buffer of `MEASURE_BYTES` (read once, written once) at MLX's
own speed on this device, the best of a few runs. It runs on the MLX thread, once per process.
"""

from __future__ import annotations

import time

import attrs
import mlx.core as mx

MEASURE_BYTES = 256 << 20  # big enough to leave every cache, small enough to take well under a second
MEASURE_RUNS = 4


@attrs.frozen
class MachineFacts:
    device_name: str  # the device's own name ("NVIDIA H100 80GB HBM3", "Apple M3 Max"), or "cpu"
    bandwidth_bytes_s: float  # measured memory bandwidth: bytes read + written per second


def machine_facts(nbytes: int = MEASURE_BYTES, runs: int = MEASURE_RUNS) -> MachineFacts:
    return MachineFacts(_device_name(), measure_bandwidth(nbytes, runs))


def measure_bandwidth(nbytes: int = MEASURE_BYTES, runs: int = MEASURE_RUNS) -> float:
    """Bytes per second one elementwise pass moves (its input read, its output written)."""
    source = mx.zeros((nbytes // 4,), dtype=mx.float32)
    mx.eval(source)
    best = float("inf")
    for _ in range(max(1, runs)):
        started = time.perf_counter()
        mx.eval(source + 1.0)
        best = min(best, time.perf_counter() - started)
    return 2 * (nbytes // 4) * 4 / max(best, 1e-9)


def _device_name() -> str:
    if mx.default_device().type == mx.cpu:
        return "cpu"
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    except Exception:  # a backend without device info
        return "gpu"
    name = info.get("device_name") or info.get("architecture")
    return str(name) if name else "gpu"

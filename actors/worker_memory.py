"""The GPU worker's memory housekeeping, on its MLX thread: how much the device can hold, and
after each row job the prompt cache's share of the room and MLX's buffer cache.

One budget holds the rows' live KV and the RAM prompt cache (actors/kv_memory.py bounds the
rows): the cache yields what the rows take, least recently used entries first. MLX keeps freed
buffers for reuse; once the last row has left they go back to the device, so an idle server
holds the model and its prompt cache, not every transient of the last burst.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from actors.policy import device_memory, system_memory_bytes

if TYPE_CHECKING:
    from cache.prompt_cache import PromptCache
    from model.engine.engine import Engine

# The jobs after which the rows' KV may have grown or shrunk.
ROW_JOBS = frozenset({"open_row", "prefill", "prefill_group", "fork_rows", "join", "join_group", "step", "close_row"})


def after_row_job(engine: Engine, kind: str, prompt_cache: PromptCache | None, kv_room: int) -> None:
    """After a job of `kind`: the prompt cache keeps at most what the open rows leave of
    `kv_room`, and once no row is open MLX's buffer cache is emptied."""
    if kind not in ROW_JOBS:
        return
    import mlx.core as mx

    if prompt_cache is not None and kv_room:
        prompt_cache.yield_to(kv_room - engine.live_kv_bytes())
    if kind == "close_row" and not engine.active_rows:
        mx.clear_cache()


def device_memory_bytes(mx: ModuleType) -> int:
    """What the device can hold (actors/policy.py `device_memory` picks the key); 0 = unknown.
    Called once the model is loaded: on CUDA, at most the free memory plus what we hold."""
    try:
        device = "cpu" if mx.default_device().type == mx.cpu else "gpu"
        info = {} if device == "cpu" else (mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info())
        free = cuda_free_bytes() if device != "cpu" and not mx.metal.is_available() else None
        own = mx.get_active_memory() + mx.get_cache_memory()  # (the model, loaded by now)
        return device_memory(device, info, ram_bytes=system_memory_bytes(), free_bytes=free, own_bytes=own)
    except Exception:
        return 0


def cuda_free_bytes() -> int | None:
    """The GPU's free memory (`cudaMemGetInfo`) through the CUDA runtime MLX has loaded (found by
    its soname); None when it cannot be read."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0:
            return int(free.value)
    return None

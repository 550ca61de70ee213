"""The command line → one validated `ServerOptions` (its groups, fields, flags and defaults are all
in model/options/), and `resolve`, the one step that turns every auto into a number once the
model is loaded and the device is known.

Nothing in the server reads the environment for its behaviour: the only environment variables
are secrets and deployment paths (docs/operations.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from model.options import ResolvedEngine, ServerOptions, resolve_engine
from model.options.flags import add_flags, from_fields, read_options

if TYPE_CHECKING:
    from actors.worker_api import ModelInfo

PROG = "mlx-trio-server"  # the console script (pyproject.toml) that runs actors.serve:main
# The joiner's chunk while other rows decode, on CPU: the long-joiner workload's worst gap
# between a running stream's tokens was a whole 2048-token chunk (1.8 s on the CPU machine).
DECODING_PREFILL_CHUNK = 512
# `--prompt-cache` auto: this fraction of the KV room the memory budget leaves, at most the 8 GiB
# the cache was before it lived inside the budget (running rows take room from it anyway).
AUTO_PROMPT_CACHE_SHARE = 4
AUTO_PROMPT_CACHE_MAX = 8 * 2**30


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`--help` has the usage), as every other start-up
    failure is; the exit code stays argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parser() -> argparse.ArgumentParser:
    """The command line, generated from the options' fields, one group per topic."""
    p = OneLineParser(
        prog=PROG if Path(sys.argv[0]).name == PROG else "python -m actors.serve",
        description="OpenAI-compatible LLM server on MLX (trio actors). No --model: the embedded demo model.",
    )
    add_flags(p, ServerOptions)
    return p


def parse_options(argv: Sequence[str] | None = None) -> ServerOptions:
    """The options the command line gives, once every rule across flags holds (a broken one
    exits 2 with one line)."""
    p = parser()
    options = read_options(p.parse_args(argv), ServerOptions)
    if problem := validate(options):
        p.error(problem)
    return options


def options(**fields: Any) -> ServerOptions:
    """Options with some fields set by their flat names (`batch=4, max_queue=2`), as tests and
    benchmarks build them; every other field keeps its one default."""
    return from_fields(ServerOptions, fields)


def validate(options: ServerOptions) -> str | None:
    """The first rule across flags that `options` breaks, or None."""
    spec = options.speculation
    if spec.draft_kind == "draft" and not spec.draft_model:
        return "--draft-kind draft needs --draft-model"
    if spec.draft_kind == "ngram" and spec.draft_model:
        return "--draft-model is only used with --draft-kind draft"
    if spec.ngram_min > spec.ngram_max:
        return "--ngram-min must not exceed --ngram-max"
    adapters = options.adapters
    if adapters.default_adapter not in (None, "none", *(i for i, _ in adapters.adapters)):
        return f"--default-adapter {adapters.default_adapter} is not the ID of an --adapter"
    if options.caches.ssd_cache_dir and options.caches.prompt_cache_gb == 0:
        return "--ssd-cache requires the RAM prompt cache (--prompt-cache 0 disables it)"
    if options.engine.isolate and options.engine.tensor_parallel > 1:
        return "--isolate cannot be combined with --tensor-parallel (its ranks are the server's own children)"
    return pool_problem(options)


def pooled(options: ServerOptions) -> bool:
    """Whether the server runs a model pool (actors/pool.py): `--model-pool` above 1 or
    `--models-dir`. Otherwise it serves the one `--model`, exactly as before the pool existed."""
    return options.model.model_pool > 1 or options.model.models_dir is not None


def pool_problem(options: ServerOptions) -> str | None:
    """The pool's rules across flags: what one MLX thread cannot hold for several models."""
    if not pooled(options):
        return "--model-ttl needs a model pool (--model-pool N or --models-dir)" if options.model.model_ttl else None
    if options.engine.tensor_parallel > 1:
        return "--tensor-parallel cannot be combined with a model pool (--model-pool, --models-dir)"
    if options.speculation.draft_model:
        return "--draft-model cannot be combined with a model pool (--model-pool, --models-dir)"
    return None


@attrs.frozen
class Resolved:
    """The options' autos as numbers, for one loaded model on one device."""

    batch: int  # rows decoding at once
    memory_budget_bytes: int
    kv_room_bytes: int  # what the budget leaves after weights and the prefill transient
    kv_budget_bytes: int  # live KV of all rows together (--kv-budget; auto: the room)
    prompt_cache_bytes: int  # the RAM prompt cache's size (--prompt-cache; auto: a share of the room)
    warm_up: bool  # decode batch sizes 1..batch are met before serving
    group_prefill: bool
    decoding_prefill_chunk: int  # a joiner's chunk while other rows decode (0 = the full chunk)
    engine: ResolvedEngine


def resolve(options: ServerOptions, info: ModelInfo) -> Resolved:
    """Every auto of `options` for the model `info` describes (its device, memory and shape)."""
    from actors.policy import memory_budget_bytes, resolve_batch

    gpu = info.device != "cpu"
    budget = memory_budget_bytes(options.admission.memory_budget_gb, device_memory_bytes=info.memory_bytes)
    batch = resolve_batch(
        options.scheduling.batch,
        budget_bytes=budget,
        weights_bytes=info.weights_bytes,
        kv_bytes_per_token=info.kv_bytes_per_token,
        context_length=info.context_length,
        transient_bytes=info.prefill_transient_bytes,
        kv_quant_ratio=info.kv_quant_ratio,
        kv_quantized_from=info.kv_quantized_from,
        state_bytes_per_row=info.state_bytes_per_row,
    )
    chunk = options.scheduling.decoding_prefill_chunk
    room = max(0, budget - info.weights_bytes - info.prefill_transient_bytes)
    kv_gb, cache_gib = options.admission.kv_budget_gb, options.caches.prompt_cache_gb
    return Resolved(
        batch=batch,
        memory_budget_bytes=budget,
        kv_room_bytes=room,
        kv_budget_bytes=int(kv_gb * 1e9) if kv_gb is not None else room,
        prompt_cache_bytes=(
            int(cache_gib * 2**30)
            if cache_gib is not None
            else min(AUTO_PROMPT_CACHE_MAX, room // AUTO_PROMPT_CACHE_SHARE)
        ),
        warm_up=options.engine.warm_up == "on" or (options.engine.warm_up == "auto" and gpu),
        # auto = on everywhere since 2026-12-05: on CPU too, once chat rows joined their groups
        # (benchmarks/results/2026-12-05/NOTES.md, item 28), grouping measured +5-11% at c=8/32.
        group_prefill=options.scheduling.group_prefill != "off",
        decoding_prefill_chunk=chunk if chunk is not None else DECODING_PREFILL_CHUNK if not gpu else 0,
        engine=resolve_engine(options.engine, gpu=gpu, cuda=info.backend == "cuda"),
    )

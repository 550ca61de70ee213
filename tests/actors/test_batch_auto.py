"""`--batch auto` and the device memory behind it: pure rules, then the root and the worker."""

from __future__ import annotations

import argparse
import logging

import attrs
import pytest

from actors.options import options as serve_options
from actors.options import resolve
from actors.policy import (
    AUTO_BATCH_ROWS,
    AUTO_ROW_CONTEXT,
    admission_ceiling,
    device_memory,
    resolve_batch,
)
from actors.root import start_actors
from model.options.values import batch_rows as parse_batch
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.options import parsed

GB = 10**9
# One prefill forward's transient, as the model would report it (model/engine/prefill_memory.py).
TRANSIENT = 2048 * 550_000
KV = 100_000  # bytes per token


def auto(budget: int, *, weights: int = 2 * GB, kv: int = KV, context: int = 40_960) -> int:
    return resolve_batch(
        None,
        budget_bytes=budget,
        weights_bytes=weights,
        kv_bytes_per_token=kv,
        context_length=context,
        transient_bytes=TRANSIENT,
    )


def room_for(rows: int, *, weights: int = 2 * GB, context: int = AUTO_ROW_CONTEXT) -> int:
    """The budget that leaves KV room for exactly `rows` rows of `context` tokens."""
    return weights + TRANSIENT + rows * context * KV


def test_auto_is_32_rows_where_their_kv_fits_and_fewer_where_it_does_not():
    assert auto(60 * GB) == AUTO_BATCH_ROWS == 32  # an 80 GB GPU's budget: plenty
    assert auto(room_for(32)) == 32
    assert auto(room_for(32) - 1) == 31
    assert auto(room_for(5) + KV) == 5
    assert auto(room_for(1)) == 1  # one row fits: the strict serial executor
    assert auto(GB) == 1  # weights alone overflow the budget: never below one row (admission refuses)


def test_auto_sizes_rows_by_the_models_context_when_it_is_shorter():
    # 512-token context: a row needs 512 tokens of KV, not AUTO_ROW_CONTEXT
    assert auto(room_for(8, context=512), context=512) == 8
    assert auto(room_for(8, context=512)) == 2
    assert auto(1, weights=0, kv=0) == 32  # no KV per token to count (unknown): the plain default


def test_an_explicit_batch_is_kept_whatever_the_memory():
    tight = {"budget_bytes": 1, "weights_bytes": GB, "kv_bytes_per_token": KV, "context_length": 4096}
    tight["transient_bytes"] = TRANSIENT
    assert [resolve_batch(n, **tight) for n in (1, 8, 32, 100)] == [1, 8, 32, 100]


def test_the_batch_flag_takes_auto_or_a_positive_integer():
    assert parse_batch("auto") is None
    assert parse_batch("12") == 12
    for bad in ("0", "-3", "x", "8.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="auto or an integer"):
            parse_batch(bad)
    assert parsed([]).batch is None and serve_options().scheduling.batch is None  # auto is the default
    assert parsed(["--batch", "auto"]).batch is None
    assert parsed(["--batch", "4"]).batch == 4
    with pytest.raises(SystemExit):
        parsed(["--batch", "0"])


def test_batch_rows_reads_the_budget_flag_and_the_model():
    info = FakeWorker().info
    tight = (info.weights_bytes + info.prefill_transient_bytes + 3 * AUTO_ROW_CONTEXT * info.kv_bytes_per_token) / 1e9
    assert resolve(serve_options(), attrs.evolve(info, context_length=10**6)).batch == 32  # 0.75 x 10^12 bytes
    assert resolve(serve_options(memory_budget_gb=tight), attrs.evolve(info, context_length=10**6)).batch == 3
    assert resolve(serve_options(batch=5, memory_budget_gb=tight), info).batch == 5


# -- which memory the budget comes from ---------------------------------------------------------

CUDA_H100 = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 85_029_158_912}
METAL_M2 = {
    "architecture": "applegpu_g14s",
    "memory_size": 68_719_476_736,  # all of RAM
    "max_recommended_working_set_size": 51_539_607_552,
    "max_buffer_length": 51_539_607_552,
}
RAM = 108_000_000_000


def test_device_memory_is_gpu_memory_on_cuda_the_working_set_on_metal_and_ram_on_cpu():
    assert device_memory("gpu", CUDA_H100, ram_bytes=RAM) == 85_029_158_912  # not the host's RAM
    assert device_memory("gpu", METAL_M2, ram_bytes=RAM) == 51_539_607_552
    assert device_memory("gpu", {"memory_size": 17_179_869_184}, ram_bytes=RAM) == 17_179_869_184
    assert device_memory("cpu", {"architecture": "x86_64", "device_name": "Xeon"}, ram_bytes=RAM) == RAM
    assert device_memory("cpu", CUDA_H100, ram_bytes=RAM) == RAM  # a CPU run on a GPU host
    assert device_memory("gpu", {"total_memory": 0, "device_name": "?"}, ram_bytes=RAM) == RAM  # unknown


# -- the root sizes the scheduler with it and logs it -------------------------------------------


async def test_the_root_resolves_auto_for_the_scheduler_and_stats(nursery, caplog):
    worker = FakeWorker()
    with caplog.at_level(logging.INFO, logger="actors.root"):
        handles = await start_actors(
            nursery, worker, options=serve_options(), make_tokenizer=lambda info: FakeTokenizer()
        )
    assert handles.scheduler.table.capacity == 32 and handles.mode == "batch"
    assert handles.resolved.batch == 32 and handles.stats()["batch"]["configured"] == 32
    assert "batch auto -> 32 rows" in caplog.text


async def test_an_explicit_batch_reaches_the_scheduler_unchanged(nursery):
    worker = FakeWorker()
    handles = await start_actors(
        nursery, worker, options=serve_options(batch=3), make_tokenizer=lambda info: FakeTokenizer()
    )
    assert handles.scheduler.table.capacity == 3 and handles.resolved.batch == 3


def test_the_kv_budget_and_the_prompt_cache_default_to_the_room_the_memory_budget_leaves():
    info = attrs.evolve(FakeWorker().info, prefill_transient_bytes=TRANSIENT, weights_bytes=GB)
    small = resolve(serve_options(memory_budget_gb=9.0), info)  # a 16 GB Mac's budget, say
    room = 9 * GB - GB - TRANSIENT
    assert (small.kv_room_bytes, small.kv_budget_bytes) == (room, room)
    assert small.prompt_cache_bytes == room // 4  # inside the budget, not 8 GiB on top of it
    big = resolve(serve_options(memory_budget_gb=200.0), info)
    assert big.prompt_cache_bytes == 8 * 2**30  # at most what it was before
    explicit = resolve(serve_options(memory_budget_gb=9.0, kv_budget_gb=2.5, prompt_cache_gb=1.0), info)
    assert (explicit.kv_budget_bytes, explicit.prompt_cache_bytes) == (int(2.5 * GB), 2**30)
    # An explicit live-KV budget bounds what one request may hold too.
    kw = {"budget_bytes": 9 * GB, "weights_bytes": GB, "kv_bytes_per_token": KV, "context_length": 10**6}
    assert admission_ceiling(**kw, transient_bytes=TRANSIENT, kv_budget_bytes=GB).usable_bytes == GB
    assert admission_ceiling(**kw, transient_bytes=TRANSIENT).usable_bytes == room


def test_cuda_budgets_the_memory_left_free_not_what_another_process_holds():
    held_elsewhere = 46 * GB
    free = CUDA_H100["total_memory"] - held_elsewhere - 5 * GB  # (5 GB: our own model, loaded)
    assert device_memory("gpu", CUDA_H100, ram_bytes=RAM, free_bytes=free, own_bytes=5 * GB) == free + 5 * GB
    assert device_memory("gpu", CUDA_H100, ram_bytes=RAM, free_bytes=None) == CUDA_H100["total_memory"]

"""--kv-quant from the command line to admission: the flags, the worker's scheme and ModelInfo,
and the KV bill (full precision until a row turns quantized, the scheme's bytes after)."""

from __future__ import annotations

import json
import logging
import shutil

import attrs
import pytest
import trio

from actors import serve
from actors.gpu_worker import GpuWorker
from actors.options import options as serve_options
from actors.options import parse_options
from actors.options import resolve as resolve_options
from actors.policy import (
    AUTO_ROW_CONTEXT,
    admission_ceiling,
    kv_bill,
    max_tokens_billed,
    resolve_batch,
)
from actors.root import start_actors
from actors.startup import load_failed
from actors.worker_api import ModelInfo, kv_fields
from model.kv.scheme import KVScheme, resolve
from model.load.errors import ModelLoadError
from model.options import KVOptions
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.options import parsed
from tests.helpers.workers import gpu_worker

GB = 10**9
# One prefill forward's transient, as the model would report it (model/engine/prefill_memory.py).
TRANSIENT = 2048 * 550_000
# An 8B llama's shape: 32 layers, 8 KV heads of 128, bf16 → K and V of 32·8·128 elements, 2 bytes.
LAYERS = 32
FP = 2 * LAYERS * 8 * 128 * 2  # 131072 bytes per token
KV8 = (1 + 4 / 64) / 2  # 8 bits per element + a bf16 scale and bias per 64: 0.53125 of bf16
KV4 = (0.5 + 4 / 64) / 2  # 0.28125
CHUNK = 2048
FROM = 6144  # the first 2048-token chunk end at or past mlx-lm's start of 5000


def scheme(mode: str, **kw) -> KVScheme:
    group = {"kv_group_size": kw["group_size"]} if "group_size" in kw else {}
    return resolve(KVOptions(kv_quant=mode, **group), model_dir=None, num_layers=LAYERS)


def ceiling(usable: int, ratio: float = 1.0, quantized_from: int = 0, context: int = 10**9) -> int:
    return admission_ceiling(
        transient_bytes=TRANSIENT,
        budget_bytes=usable + TRANSIENT,
        weights_bytes=0,
        kv_bytes_per_token=FP,
        context_length=context,
        kv_quant_ratio=ratio,
        kv_quantized_from=quantized_from,
    ).max_safe_context


# --- the scheme as ModelInfo reports it ------------------------------------------------------


def test_model_info_fields_of_each_scheme():
    assert kv_fields(scheme("8"), num_layers=LAYERS, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=CHUNK) == {
        "kv_scheme": "kv8",
        "kv_quant_ratio": KV8,
        "kv_quantized_from": FROM,
        "kv_group_size": 64,
        "kv_bits": 8,
        "kv_start": 5000,
        "kv_paged": False,
    }
    four = kv_fields(
        scheme("4", group_size=32), num_layers=LAYERS, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=512
    )
    assert (four["kv_scheme"], four["kv_quant_ratio"], four["kv_quantized_from"]) == ("kv4", (0.5 + 4 / 32) / 2, 5120)
    off = kv_fields(scheme("off"), num_layers=LAYERS, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=CHUNK)
    assert off == {
        "kv_scheme": "bf16",
        "kv_quant_ratio": 1.0,
        "kv_quantized_from": 0,
        "kv_group_size": None,
        "kv_bits": None,
        "kv_start": 5000,
        "kv_paged": False,
    }
    # full-precision KV is named by its dtype; a quantized scheme's name does not change with it
    for dtype_name, label in [("mlx.core.float32", "f32"), ("float16", "f16"), ("mlx.core.bfloat16", "bf16")]:
        full = kv_fields(scheme("off"), num_layers=LAYERS, dtype_name=dtype_name, dtype_bytes=4, prefill_chunk=CHUNK)
        assert full["kv_scheme"] == label
    f32_kv8 = kv_fields(scheme("8"), num_layers=LAYERS, dtype_name="float32", dtype_bytes=4, prefill_chunk=CHUNK)
    assert f32_kv8["kv_scheme"] == "kv8"


def test_a_mixed_kv_config_reports_each_layers_bits(tmp_path):
    (tmp_path / "kv_config.json").write_text(json.dumps({"bits": 8, "layers": {"0": 4, "2": None}}))
    mixed = resolve(KVOptions(kv_quant="config", quantized_kv_start=100), model_dir=tmp_path, num_layers=4)
    fields = kv_fields(mixed, num_layers=4, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=64)
    assert fields["kv_scheme"] == "mixed (kv_config.json)" and fields["kv_bits"] == (4, 8, None, 8)
    assert fields["kv_quantized_from"] == 128 and fields["kv_quant_ratio"] == pytest.approx((KV4 + 2 * KV8 + 1) / 4)
    # no kv_config.json: config mode stores full precision
    plain = resolve(KVOptions(kv_quant="config", quantized_kv_start=0), model_dir=tmp_path / "none", num_layers=4)
    assert (
        kv_fields(plain, num_layers=4, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=64)["kv_quantized_from"] == 0
    )


# --- the bill and the ceiling ----------------------------------------------------------------


def test_a_row_is_billed_full_precision_until_it_turns_quantized_then_the_schemes_bytes():
    def bill(n: int, ratio: float = KV8) -> int:
        return kv_bill(n, kv_bytes_per_token=FP, kv_quant_ratio=ratio, kv_quantized_from=FROM)

    assert bill(1000) == 1000 * FP  # short rows stay full precision
    assert bill(FROM) == FROM * FP
    assert bill(FROM + 1) == FROM * FP  # the full-precision peak before conversion still bounds it
    assert bill(100_000) == pytest.approx(100_000 * FP * KV8, abs=1) and bill(100_000, KV4) < bill(100_000)
    assert kv_bill(100_000, kv_bytes_per_token=FP) == 100_000 * FP  # not quantized: fp throughout
    assert kv_bill(100_000, kv_bytes_per_token=FP, kv_quant_ratio=KV8) == 100_000 * FP  # never converts


@pytest.mark.parametrize(("ratio", "name"), [(KV8, "kv8"), (KV4, "kv4")])
def test_on_a_long_budget_the_max_safe_context_grows_by_about_one_over_the_ratio(ratio, name):
    usable = 40 * GB
    off, quantized = ceiling(usable), ceiling(usable, ratio, FROM)
    assert off == usable // FP
    assert quantized == pytest.approx(off / ratio, rel=1e-4), name
    # exactly the largest length the bill allows
    bill = {"kv_bytes_per_token": FP, "kv_quant_ratio": ratio, "kv_quantized_from": FROM}
    assert kv_bill(quantized, **bill) <= usable < kv_bill(quantized + 1, **bill)
    assert max_tokens_billed(usable, **bill) == quantized
    assert ceiling(usable, ratio, FROM, context=131_072) == 131_072  # still capped at the context


@pytest.mark.parametrize("ratio", [KV8, KV4])
def test_a_budget_smaller_than_the_full_precision_part_is_billed_at_full_precision(ratio):
    usable = 1000 * FP + 7
    assert ceiling(usable, ratio, FROM) == ceiling(usable) == 1000
    just_short = FROM * FP - 1  # one byte short of the full-precision peak
    assert ceiling(just_short, ratio, FROM) == FROM - 1
    # at the peak the quantized rate takes over: the row may grow to peak / ratio
    assert ceiling(FROM * FP, ratio, FROM) == int(FROM / ratio)
    assert ceiling(0, ratio, FROM) == ceiling(-5 * GB, ratio, FROM) == 0


def test_auto_batch_sizes_rows_with_the_same_bill():
    def rows(ratio: float, quantized_from: int) -> int:
        return resolve_batch(
            None,
            budget_bytes=TRANSIENT + 8 * AUTO_ROW_CONTEXT * FP,
            weights_bytes=0,
            kv_bytes_per_token=FP,
            context_length=40_960,
            transient_bytes=TRANSIENT,
            kv_quant_ratio=ratio,
            kv_quantized_from=quantized_from,
        )

    assert rows(1.0, 0) == 8
    assert rows(KV4, FROM) == 8  # a 2048-token row never turns quantized at 6144: billed at fp
    # quantized from the first 512-token chunk: a 2048-token row bills max(512, 0.28125·2048) = 576 tokens
    assert rows(KV4, 512) == (8 * AUTO_ROW_CONTEXT) // 576


async def test_the_root_bills_admission_and_batch_with_the_models_scheme(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="actors.root")
    fake = FakeWorker()
    info = attrs.evolve(
        fake.info,
        context_length=10**6,
        kv_bytes_per_token=FP,
        **kv_fields(scheme("8"), num_layers=LAYERS, dtype_name="bfloat16", dtype_bytes=2, prefill_chunk=CHUNK),
    )
    worker = FakeWorker(info=info)
    usable = 40 * GB
    config = serve_options(memory_budget_gb=(usable + info.weights_bytes + info.prefill_transient_bytes) / GB)
    async with trio.open_nursery() as nursery:
        handles = await start_actors(nursery, worker, options=config, make_tokenizer=lambda info: FakeTokenizer())
        assert handles.ceiling.max_safe_context == ceiling(usable, KV8, FROM)
        assert handles.ceiling.max_safe_context > 1.8 * (usable // FP)
        assert resolve_options(config, info).batch == 32
        nursery.cancel_scope.cancel()
    loaded = next(r.getMessage() for r in caplog.records if "loaded in" in r.getMessage())
    assert loaded.endswith("KV kv8)")  # the start-up lines name the scheme and its billing
    assert any("KV kv8: 0.531 of full precision past 6144 tokens" in r.getMessage() for r in caplog.records)


# --- flags and the real worker ----------------------------------------------------------------


def test_kv_flags_reach_the_options_and_the_planned_worker(qwen3_dir):
    default = parsed([])
    assert (default.kv_quant, default.kv_group_size, default.quantized_kv_start) == ("off", 64, 5000)
    args = ["--model", str(qwen3_dir), "--kv-quant", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    config = parsed(args)
    assert (config.kv_quant, config.kv_group_size, config.quantized_kv_start) == ("4", 32, 0)
    _, worker, _ = serve._load_plan(parse_options(args))
    assert isinstance(worker, GpuWorker) and worker.options.kv == KVOptions("4", 32, 0)


@pytest.mark.parametrize(
    "argv",
    [["--kv-quant", "3"], ["--kv-quant", "bf16"], ["--kv-group-size", "48"], ["--quantized-kv-start", "-1"]],
)
def test_bad_kv_flags_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exited:
        parsed(argv)
    assert exited.value.code == 2


async def test_the_worker_reports_its_scheme(qwen3_dir):
    worker = gpu_worker(qwen3_dir, eos_token_ids=[], kv_quant="8", kv_group_size=32, quantized_kv_start=64)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            info: ModelInfo = await nursery.start(worker.run)
            scheme_of_engine = await worker.run_exclusive(lambda engine: engine.kv_scheme)
            nursery.cancel_scope.cancel()
    assert (info.kv_scheme, info.kv_bits, info.kv_group_size, info.kv_start) == ("kv8", 8, 32, 64)
    # float32 activations: 1 byte per element + two 4-byte floats per 32, over 4 bytes
    assert info.kv_quantized_from == worker.prefill_chunk and info.kv_quant_ratio == (1 + 8 / 32) / 4
    assert scheme_of_engine.label == "kv8" and scheme_of_engine.start == 64
    assert len(scheme_of_engine.layers) == scheme_of_engine.layers.count(scheme_of_engine.layers[0]) > 0


async def test_a_bad_kv_config_fails_start_up_in_one_line_as_a_usage_error(qwen3_dir, tmp_path):
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "model")
    (model_dir / "kv_config.json").write_text(json.dumps({"bits": 7}))
    worker = gpu_worker(model_dir, eos_token_ids=[], kv_quant="config")
    with pytest.RaisesGroup(pytest.RaisesExc(ModelLoadError, match="bits 7"), flatten_subgroups=True) as caught:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
    failed = load_failed(str(model_dir), caught.value)
    assert failed.usage and "kv_config.json" in failed.message and "\n" not in failed.message


def test_a_rows_fixed_recurrent_state_is_billed_before_its_tokens():
    from actors.policy import admission_ceiling, resolve_batch

    kv = 1000  # bytes per token
    plain = admission_ceiling(
        transient_bytes=TRANSIENT, budget_bytes=10**10, weights_bytes=10**9, kv_bytes_per_token=kv, context_length=10**9
    )
    hybrid = admission_ceiling(
        transient_bytes=TRANSIENT,
        budget_bytes=10**10,
        weights_bytes=10**9,
        kv_bytes_per_token=kv,
        context_length=10**9,
        state_bytes_per_row=5 * 10**6,
    )
    assert plain.max_safe_context - hybrid.max_safe_context == 5000  # the state's bytes, in tokens
    rows = {
        state: resolve_batch(
            None,
            budget_bytes=4 * 10**9,
            weights_bytes=0,
            kv_bytes_per_token=kv,
            context_length=4096,
            transient_bytes=TRANSIENT,
            state_bytes_per_row=state,
        )
        for state in (0, 300 * 10**6)
    }
    assert rows[300 * 10**6] < rows[0] == 32


def test_the_hybrid_models_state_reaches_model_info(tiny_model_factory):
    from actors.worker_api import loaded_fields
    from model.load.loader import load_model

    loaded = load_model(tiny_model_factory("qwen3_5", num_hidden_layers=4, head_dim=16))
    expected = loaded.model.state_bytes_per_row(loaded.kv_dtype.size)
    assert expected > 0 and loaded_fields(loaded)["state_bytes_per_row"] == expected
    plain = load_model(tiny_model_factory("qwen3"))
    assert loaded_fields(plain)["state_bytes_per_row"] == 0

"""Speculative decoding's flags and start-up: defaults, the drafter each combination picks, bad
combinations as usage errors, a draft model with another vocabulary refused in one line, and
speculation switched off (with a warning) under a quantized KV cache."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from actors import serve
from actors.gpu_worker import GpuWorker
from actors.options import parse_options
from actors.startup import load_failed
from actors.worker_api import ModelInfo
from model.engine.speculation_setup import SpecChoice, spec_choice
from model.load.errors import ModelLoadError
from model.options import ServerOptions, SpeculationOptions
from tests.helpers.options import parsed
from tests.helpers.workers import gpu_worker

DEFAULTS = SpeculationOptions()
DEFAULT_DRAFT_TOKENS, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN = (
    DEFAULTS.num_draft_tokens,
    DEFAULTS.ngram_max,
    DEFAULTS.ngram_min,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_line_imports_no_mlx():
    # --blas must act before MLX loads (it binds its BLAS then): the flags' defaults may not pull it in.
    code = "import sys; from actors.options import parse_options; parse_options([]); print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def config_of(*argv: str) -> ServerOptions:
    return parse_options(list(argv))


def test_by_default_nothing_speculates():
    config = config_of().speculation
    assert (config.draft_model, config.draft_kind) == (None, None)
    assert (config.num_draft_tokens, config.ngram_max, config.ngram_min) == (3, 4, 2)
    assert spec_choice(config) is None


def test_ngram_alone_turns_on_prompt_lookup():
    assert spec_choice(config_of("--draft-kind", "ngram").speculation) == SpecChoice(
        kind="ngram",
        num_draft_tokens=DEFAULT_DRAFT_TOKENS,
        ngram_max=DEFAULT_NGRAM_MAX,
        ngram_min=DEFAULT_NGRAM_MIN,
    )
    tuned = config_of("--draft-kind", "ngram", "--num-draft-tokens", "5", "--ngram-max", "6", "--ngram-min", "3")
    assert spec_choice(tuned.speculation) == SpecChoice(kind="ngram", num_draft_tokens=5, ngram_max=6, ngram_min=3)


def test_a_draft_model_means_draft_and_is_resolved_like_model(qwen3_dir):
    config = config_of("--model", str(qwen3_dir), "--draft-model", str(qwen3_dir), "--num-draft-tokens", "2")
    spec = config.speculation
    assert spec.draft_kind is None and spec.draft_model == str(qwen3_dir)
    choice = spec_choice(spec)
    assert choice is not None and (choice.kind, choice.draft_dir, choice.num_draft_tokens) == ("draft", qwen3_dir, 2)
    assert spec_choice(config_of("--draft-kind", "draft", "--draft-model", str(qwen3_dir)).speculation) == SpecChoice(
        kind="draft", num_draft_tokens=DEFAULT_DRAFT_TOKENS, ngram_max=4, ngram_min=2, draft_dir=qwen3_dir
    )
    _, worker, _ = serve._load_plan(config)
    assert isinstance(worker, GpuWorker) and worker.speculation == choice


def test_a_missing_draft_model_fails_the_load_plan(qwen3_dir, tmp_path):
    config = config_of("--model", str(qwen3_dir), "--draft-model", str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError):
        serve._load_plan(config)


@pytest.mark.parametrize(
    "argv",
    [
        ["--draft-kind", "draft"],  # no draft model
        ["--draft-kind", "ngram", "--draft-model", "x"],
        ["--draft-kind", "eagle"],
        ["--num-draft-tokens", "0"],
        ["--ngram-min", "0"],
        ["--draft-kind", "ngram", "--ngram-min", "5", "--ngram-max", "3"],
    ],
)
def test_bad_speculation_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        parsed(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


# --- the real worker ----------------------------------------------------------------------------


async def start(worker: GpuWorker) -> tuple[ModelInfo, object]:
    """The worker's ModelInfo and its engine's speculator (None when speculation is off)."""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            info: ModelInfo = await nursery.start(worker.run)
            speculator = await worker.run_exclusive(lambda engine: engine.speculator)
            nursery.cancel_scope.cancel()
    return info, speculator


async def test_the_worker_reports_its_drafter(qwen3_dir, tmp_path):
    info, speculator = await start(gpu_worker(qwen3_dir, eos_token_ids=[], draft_kind="ngram"))
    assert info.speculation == "ngram k=3 n=2..4" and speculator is not None
    draft_dir = shutil.copytree(qwen3_dir, tmp_path / "little-draft")
    drafted = gpu_worker(qwen3_dir, eos_token_ids=[], draft_model=str(draft_dir), num_draft_tokens=2)
    info, speculator = await start(drafted)
    assert info.speculation == "draft:little-draft k=2" and speculator is not None
    info, speculator = await start(gpu_worker(qwen3_dir, eos_token_ids=[]))
    assert info.speculation == "" and speculator is None


async def test_a_draft_model_with_another_vocabulary_is_refused_in_one_line(tiny_model_factory):
    target = tiny_model_factory("qwen3")
    other = tiny_model_factory("qwen3", tokenizer_vocab=300)
    worker = gpu_worker(target, eos_token_ids=[], draft_model=str(other))
    with pytest.RaisesGroup(
        pytest.RaisesExc(ModelLoadError, match="tokenizer vocabularies differ"), flatten_subgroups=True
    ) as caught:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
    failed = load_failed(str(target), caught.value)
    assert failed.usage and "\n" not in failed.message  # exit 2, one line
    assert str(target) in failed.message and str(other) in failed.message


async def test_a_quantized_kv_cache_turns_speculation_off_with_a_warning(qwen3_dir, caplog):
    caplog.set_level(logging.WARNING)
    info, speculator = await start(gpu_worker(qwen3_dir, eos_token_ids=[], kv_quant="8", draft_kind="ngram"))
    assert info.speculation == "" and speculator is None and info.kv_scheme == "kv8"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("speculative decoding" in w and "off" in w and "--kv-quant" in w for w in warnings), warnings
    caplog.clear()
    # --kv-quant config on a model that ships no kv_config.json stores full precision: no conflict
    info, speculator = await start(gpu_worker(qwen3_dir, eos_token_ids=[], kv_quant="config", draft_kind="ngram"))
    assert info.speculation == "ngram k=3 n=2..4" and speculator is not None
    assert not [r for r in caplog.records if "speculative decoding" in r.getMessage()]

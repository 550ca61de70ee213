"""The registry's MLX-thread check before a row opens: a stack the engine cannot run (a DoRA
adapter with another, e.g. remounted as DoRA after the route's check) is that request's 400,
in the words of the engine's own rule (model/lora/stack.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.adapter_registry import AdapterNotStackable, mounted_for
from actors.worker_api import AdapterNotMounted, AdapterReport
from model.engine.params import SamplingParams
from model.engine.rows import RowSpec
from model.lora.stack import stack_problem


def report(adapter_id: str, kind: str = "lora") -> AdapterReport:
    return AdapterReport(adapter_id, f"/p/{adapter_id}", kind, 8, 1000, f"fp-{adapter_id}")


def engine_with(*reports: AdapterReport) -> SimpleNamespace:
    return SimpleNamespace(adapters=SimpleNamespace(infos=lambda: list(reports)))


def spec(*adapters: str) -> RowSpec:
    return RowSpec(0, (1, 2, 3), SamplingParams(), 4, adapters=adapters)


def test_a_dora_adapter_runs_alone():
    assert stack_problem([report("d", "dora")]) is None
    assert stack_problem([report("a"), report("b")]) is None
    assert stack_problem([report("a"), report("d", "dora")]) == (
        "adapter 'd' is a DoRA adapter, which cannot be stacked with another: select it alone"
    )
    assert stack_problem([report("d", "dora"), report("e", "dora")]) is not None


def test_mounted_for_refuses_a_stack_it_cannot_run_as_the_requests_mistake():
    engine = engine_with(report("a"), report("d", "dora"))
    assert mounted_for(engine, spec("d")) == spec("d")  # type: ignore[arg-type]
    with pytest.raises(AdapterNotStackable) as refused:
        mounted_for(engine, spec("a", "d"))  # type: ignore[arg-type]
    assert str(refused.value) == stack_problem([report("a"), report("d", "dora")])  # the one message
    assert isinstance(refused.value, AdapterNotMounted)  # the scheduler's 400, never a worker failure
    with pytest.raises(AdapterNotMounted, match="'z' is not mounted"):
        mounted_for(engine, spec("a", "z"))  # type: ignore[arg-type]

"""An abort stops a prefill forward between layers, keeps nothing of it, and changes no output.

The abort is deterministic here: `AbortAfter` answers the forward's checks and flags the row at
the n-th one, as the scheduler's thread would mid-chunk. The timed version, with the real worker
thread and scheduler, is tests/actors/test_prefill_abort_real.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import mlx.core as mx
import numpy as np
import pytest

from cache.prompt_cache import PromptCache
from model.engine.abort_flags import AbortFlags
from model.engine.engine import Engine
from model.engine.params import SamplingParams
from model.engine.prefill_abort import LayerCheckpoints, PrefillAborted
from model.engine.rows import RowSpec
from model.kv.cache import make_caches
from model.load.loader import load_model
from model.options import EngineOptions
from tests.engine_helpers import generate_tokens

CHUNK = 64
LAYERS = 4


def rand_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


P = rand_tokens(300, 7)


class AbortAfter(AbortFlags):
    """Flags `row_id` at the `checks`-th layer check from now (every row's forward counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: tuple[int, int] | None = None
        self.checks = 0

    def arm(self, row_id: int, checks: int) -> None:
        self.armed, self.checks = (row_id, checks), 0

    def all_of(self, row_ids: Iterable[int]) -> bool:
        self.checks += 1
        if self.armed is not None and self.checks == self.armed[1]:
            self.add(self.armed[0])
        return super().all_of(row_ids)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return load_model(tiny_model_factory("qwen3", num_hidden_layers=LAYERS)).model


@pytest.fixture(scope="module")
def cold(model):
    return Engine(model, eos_token_ids=[], options=EngineOptions(prefill_chunk=CHUNK))


def spec(row_id: int, prompt: list[int], **kw) -> RowSpec:
    return RowSpec(row_id, tuple(prompt), SamplingParams(), 12, **kw)


def hot_engine(model, flags: AbortFlags) -> Engine:
    return Engine(
        model,
        eos_token_ids=[],
        prompt_cache=PromptCache(1 << 30),
        options=EngineOptions(prefill_chunk=CHUNK),
        aborts=flags,
    )


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


@pytest.mark.parametrize("gpu_mode", [False, True], ids=["cpu-checks", "gpu-checks"])
def test_checks_between_layers_change_no_bit(model, gpu_mode):
    # Evaluating a forward in pieces runs the same kernels on the same inputs.
    tokens = mx.array(P[:-1])[None]
    plain = make_caches(LAYERS)
    expected = model(tokens, plain)
    mx.eval(expected, [c.state for c in plain])
    checked = make_caches(LAYERS)
    stops = LayerCheckpoints(lambda: False, LAYERS, every=2 if gpu_mode else 1, ahead=gpu_mode)
    got = model(tokens, checked, after_layer=stops)
    mx.eval(got, [c.state for c in checked])
    assert np.array_equal(bits(got), bits(expected))
    for a, b in zip(checked, plain):
        assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(a.state, b.state))


def test_no_check_after_the_last_layer(model):
    # A prefill evaluates only the caches: the last block's attention and MLP are never needed,
    # and a check after it would compute them.
    checks: list[int] = []
    stops = LayerCheckpoints(lambda: bool(checks.append(0)), LAYERS)
    caches = make_caches(LAYERS)
    model(mx.array(P[:CHUNK])[None], caches, after_layer=stops)
    assert len(checks) == LAYERS - 1


@pytest.mark.parametrize("gpu_mode", [False, True], ids=["cpu-checks", "gpu-checks"])
def test_checkpoints_stop_the_forward_where_asked(model, gpu_mode):
    seen: list[int] = []
    stops = LayerCheckpoints(lambda: len(seen) >= 2, LAYERS, every=1, ahead=gpu_mode)

    def after_layer(index: int, hidden: mx.array) -> None:
        seen.append(index)
        stops(index, hidden)

    with pytest.raises(PrefillAborted):
        model(mx.array(P[:CHUNK])[None], make_caches(LAYERS), after_layer=after_layer)
    assert seen == [0, 1]  # layers 2 and 3 were never built


@pytest.mark.parametrize("gpu_mode", [False, True], ids=["cpu-checks", "gpu-checks"])
def test_abort_mid_chunk_drops_the_row_and_a_later_identical_prompt_matches_cold(model, cold, gpu_mode, monkeypatch):
    if gpu_mode:  # the GPU's schedule (every 2 layers here, one ahead), run on the CPU
        monkeypatch.setattr(
            LayerCheckpoints,
            "for_device",
            classmethod(lambda cls, stop, layers, gpu: cls(stop, layers, every=2, ahead=True)),
        )
    flags = AbortAfter()
    hot = hot_engine(model, flags)
    # A boundary snapshot at 150 lies in chunk 3 (128-192): the chunk that is aborted.
    hot.open_row(spec(0, P, snapshot_at=150))
    assert hot.prefill(0).done == CHUNK
    assert hot.prefill(0).done == 2 * CHUNK
    flags.arm(0, checks=1)  # flagged at the first check of chunk 3: layer 0 (CPU) or 1 (GPU) ran
    progress = hot.prefill(0)
    assert progress.remaining == len(P) - 1 and progress.done == 0  # nothing of it is kept
    assert flags.checks == 1  # no later layer checked: the forward ended there
    assert hot.row_caches(0) == []
    with pytest.raises(RuntimeError, match="aborted"):
        hot.prefill(0)
    with pytest.raises(RuntimeError):
        hot.join(0)
    hot.close_row(0, reusable=True)  # even asked to, an aborted row puts nothing
    assert 0 not in flags
    assert hot.prompt_cache.stats()["entries"] == 0
    # the same prompt again, on the same engine: exactly the cold run's tokens
    again = generate_tokens(hot, [spec(1, P, snapshot_at=150)], reusable=True)[1]
    assert again == generate_tokens(cold, [spec(0, P)])[0]


def test_a_group_forward_stops_only_when_all_its_rows_are_aborted(model, cold):
    flags = AbortAfter()
    hot = hot_engine(model, flags)
    a, b = rand_tokens(40, 1), rand_tokens(50, 2)
    hot.open_row(spec(1, a))
    hot.open_row(spec(2, b))
    flags.add(1)  # one of two rows aborted: the forward runs on for the other
    assert [p.remaining for p in hot.prefill_group([1, 2])] == [0, 0]
    hot.close_row(1)
    first = hot.join(2)
    out = [first.token]
    while len(out) < 12:
        out += [t.token for t in hot.step()]
    hot.close_row(2)
    assert out == generate_tokens(cold, [spec(0, b)])[0]

    hot.open_row(spec(3, a))
    hot.open_row(spec(4, b))
    flags.add(3)
    flags.arm(4, checks=2)  # both aborted at the second layer: the group forward stops
    assert [p.remaining for p in hot.prefill_group([3, 4])] == [len(a) - 1, len(b) - 1]
    assert flags.checks == 2
    hot.close_row(3, reusable=True)
    hot.close_row(4, reusable=True)
    assert hot.prompt_cache.stats()["entries"] == 0 and hot.active_rows == 0

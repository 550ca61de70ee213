"""The default adapter through the real server over a tiny model: the one `--adapter` given at
start-up (or, with several, `--default-adapter`) is what requests without an `adapter` field run
on, equal to mlx-lm's greedy tokens with that adapter loaded; `"adapter": "none"` is the base
model, equal to mlx-lm without it."""

from __future__ import annotations

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import load_adapters
from mlx_lm.utils import load_model as mlx_lm_load_model

from actors.options import parse_options
from tests.fixtures.lora import write_adapter
from tests.realserver import COMPLETIONS, real_server

LIMIT_S = 120
PROMPT = [5, 17, 42, 99, 3, 250, 11, 7]
N = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


def reference(model_dir, adapter_dir=None) -> list[int]:
    model, _ = mlx_lm_load_model(model_dir)
    if adapter_dir is not None:
        load_adapters(model, str(adapter_dir))
        model.eval()
    return [int(token) for token, _ in generate_step(mx.array(PROMPT), model, max_tokens=N)]


async def tokens(server, **extra) -> tuple[list[int], str]:
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.0, "logprobs": 0, "return_tokens_as_token_ids": True}
    response = await server.client.post(COMPLETIONS, json={**body, **extra})
    assert response.status_code == 200, await response.get_data()
    answer = await response.get_json()
    named = answer["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in named], answer["model"]


async def test_the_one_adapter_is_the_default_and_none_is_the_base(model_dir, tmp_path):
    adapter = write_adapter(tmp_path / "a", model_dir, seed=1)
    adapted, base = reference(model_dir, adapter), reference(model_dir)
    assert adapted != base  # the adapter matters: the checks below can fail
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, adapters=(("a", str(adapter)),)) as server:
            got, model = await tokens(server)
            assert got == adapted and model.endswith(":a")
            assert (await tokens(server, adapter=None))[0] == adapted  # null is "not given"
            assert await tokens(server, adapter="none") == (base, server.handles.info.name)
            assert (await tokens(server, adapter=""))[0] == base
            assert (await tokens(server, adapter="a"))[0] == adapted
            # unmounted, the default is gone with it: requests run on the base model
            assert (await server.client.delete("/v1/adapters/a")).status_code == 200
            assert (await tokens(server))[0] == base


async def test_with_several_the_flag_picks_one(model_dir, tmp_path):
    first = write_adapter(tmp_path / "a", model_dir, seed=1)
    second = write_adapter(tmp_path / "b", model_dir, seed=2)
    mounted = (("a", str(first)), ("b", str(second)))
    with trio.fail_after(LIMIT_S):
        async with real_server(model_dir, adapters=mounted, default_adapter="b") as server:
            assert (await tokens(server))[0] == reference(model_dir, second)
            assert (await tokens(server, adapter="a"))[0] == reference(model_dir, first)
        async with real_server(model_dir, adapters=mounted) as server:  # several, none picked: the base
            assert (await tokens(server))[0] == reference(model_dir)


def test_the_default_must_be_a_mounted_id(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_options(["--adapter", "a=/x", "--default-adapter", "b"])
    assert exit_.value.code == 2
    assert "--default-adapter b is not the ID of an --adapter" in capsys.readouterr().err
    assert parse_options(["--adapter", "a=/x", "--default-adapter", "none"]).adapters.default is None
    assert parse_options(["--adapter", "a=/x"]).adapters.default == "a"
    assert parse_options(["--adapter", "a=/x", "--adapter", "b=/y"]).adapters.default is None

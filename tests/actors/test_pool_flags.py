"""The model pool's flags: what turns it on, and what it cannot be combined with."""

from __future__ import annotations

import pytest

from actors.options import parse_options, pooled


def test_the_pool_is_on_with_a_size_above_one_or_a_models_dir() -> None:
    assert not pooled(parse_options([]))
    assert not pooled(parse_options(["--model-pool", "1"]))
    assert pooled(parse_options(["--model-pool", "2"]))
    assert pooled(parse_options(["--models-dir", "/models"]))
    options = parse_options(["--model-pool", "3", "--model-ttl", "60", "--model-load-timeout", "10"])
    assert (options.model.model_pool, options.model.model_ttl, options.model.model_load_timeout) == (3, 60.0, 10.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-ttl", "60"], "--model-ttl needs a model pool"),
        (["--model-pool", "2", "--tensor-parallel", "2"], "--tensor-parallel cannot be combined with a model pool"),
        (["--models-dir", "/m", "--draft-model", "/d"], "--draft-model cannot be combined with a model pool"),
        (["--model-pool", "0"], "must be >= 1"),
    ],
)
def test_what_the_pool_refuses(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_options(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err

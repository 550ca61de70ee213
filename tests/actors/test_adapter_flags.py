"""`--adapter ID=PATH` / `--adapters-dir`: parsing, ServeConfig, and start-up mounting (a bad one
is a one-line usage failure)."""

from __future__ import annotations

import pytest
import trio

from actors.options import options as serve_options
from actors.root import start_actors
from actors.startup import StartupFailed, find, load_failed, startup_failure
from tests.fakes import FakeTokenizer, FakeWorker
from tests.helpers.options import parsed


def test_flags_fill_the_config():
    args = parsed(["--adapter", "a=/x/a", "--adapter", "b.v2=rel/b", "--adapters-dir", "/srv/ad"])
    config = args
    assert config.adapters == (("a", "/x/a"), ("b.v2", "rel/b"))
    assert config.adapters_dir == "/srv/ad"
    default = parsed([])
    assert default.adapters == () and default.adapters_dir is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--adapter", "a"],  # no path
        ["--adapter", "=/x"],  # no id
        ["--adapter", "a+b=/x"],  # "+" stacks ids in requests
        ["--adapter", "m:a=/x"],  # ":" separates model and adapter names
        ["--adapter", "none=/x"],  # "none" selects the base model
        ["--adapter", "..=/x"],  # a leading "." (DIR/<id> must stay inside --adapters-dir)
        ["--adapter", "a/b=/x"],  # not one path segment
        ["--adapter", "a=/x", "--adapter", "a=/y"],  # twice
    ],
)
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        parsed(argv)
    assert exited.value.code == 2
    assert "--adapter" in capsys.readouterr().err


async def test_flag_adapters_are_mounted_at_start_up_in_order(autojump_clock):
    worker = FakeWorker()
    config = serve_options(adapters=(("a", "/p/a"), ("b", "/p/b")))
    async with trio.open_nursery() as nursery:
        handles = await start_actors(nursery, worker, options=config, make_tokenizer=lambda info: FakeTokenizer())
        assert [r.id for r in handles.adapters.infos()] == ["a", "b"]
        assert list(worker.adapters) == ["a", "b"]
        assert handles.ceiling.adapter_bytes == 1000 + 2000
        nursery.cancel_scope.cancel()


async def test_a_bad_flag_adapter_is_a_one_line_usage_failure(autojump_clock):
    config = serve_options(adapters=(("a", "/p/a"), ("b", "/p/bad")))
    with pytest.raises(BaseExceptionGroup) as raised:
        async with trio.open_nursery() as nursery:
            await start_actors(nursery, FakeWorker(), options=config, make_tokenizer=lambda info: FakeTokenizer())
    failed = find(raised.value, StartupFailed)
    assert isinstance(failed, StartupFailed) and failed.usage and failed.message.startswith("--adapter b=/p/bad: ")
    assert "shapes do not fit" in failed.message and "\n" not in failed.message
    # The root wraps start-up errors with `load_failed`: it keeps this one as it is (exit 2).
    wrapped = load_failed("some/model", ExceptionGroup("start-up", [failed]))
    assert wrapped is failed
    failure = startup_failure(ExceptionGroup("root", [wrapped]))
    assert failure is not None and failure.exit_code == 2

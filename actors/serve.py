"""`python -m actors.serve`: the process entry point — flags, logging, signals, exit code.

The flags build one `ServerOptions` (actors/options.py `parse_options`; every option and flag is
declared in model/options/groups.py); `--blas` and `--log-level` act first (MLX binds its BLAS
when it loads). The signal receiver opens before anything else; the
first SIGINT/SIGTERM starts the graceful shutdown (actors/root.py), the second cancels
everything; a wall-clock watchdog hard-exits if a client that stopped reading pins a connection
(hypercorn shields its socket writes, so no cancel can free it). Every deadline is the
`ShutdownPlan`'s (actors/shutdown.py).

Exit codes: 0 after a graceful shutdown; 1 when the SSD tier's shutdown flush lost an entry it
had to keep, when the watchdog fired, or on a start-up failure that is not the command line's
fault; 2 for a bad command line (a flag, the --model directory, a busy port, an unusable
--ssd-cache, a module in the working directory shadowing ours: one line, actors/startup.py,
actors/preflight.py, actors/shadowing.py); 130 when a second signal cut the shutdown short.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

    from actors.pool_setup import PoolSetup
    from actors.root import RunnableWorker
    from actors.shutdown import ShutdownPlan
    from actors.worker_api import ModelInfo
    from model.options import ServerOptions
    from model.text.tokenizer import Tokenizer

log = logging.getLogger("actors.serve")

_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
SECOND_SIGNAL_EXIT = 130  # the shell's code for "ended by Ctrl-C": streams were cut, not finished


def main(argv: Sequence[str] | None = None) -> int:
    """The process entry point (also the `mlx-trio-server` console script's); the exit code."""
    # Before any of our other packages is imported: one in the working directory would win.
    from actors.shadowing import shadowing_problem

    if problem := shadowing_problem():
        sys.stderr.write(f"cannot serve: {problem}\n")
        return 2
    from actors.options import parse_options

    options = parse_options(argv)
    level = _LOG_LEVELS[options.observability.log_level]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before anything can import mlx: MLX's CPU backend binds its BLAS at load time.
    from model.load.blas import preload_optimized_blas

    blas = preload_optimized_blas(options.engine.blas)
    from actors.preflight import preflight
    from actors.startup import FAILURE_EXIT, USAGE_EXIT, StartupFailed

    try:
        options = preflight(options)  # the paths, before the port or any weight
    except StartupFailed as exc:  # (the BLAS line would only bury this one)
        log.error("cannot serve: %s", exc.message, exc_info=exc if log.isEnabledFor(logging.DEBUG) else None)
        return USAGE_EXIT if exc.usage else FAILURE_EXIT
    log.info(blas.log_line())
    try:
        import trio

        return trio.run(_main, options)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was open (imports, startup)
        return 130


async def _main(options: ServerOptions) -> int:
    import trio

    from actors.messages import FlushResult
    from actors.root import run_server
    from actors.shutdown import Shutdown, ShutdownPlan
    from actors.startup import startup_failure
    from actors.tp.leader import on_rank_failure, rank_failed

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        shutdown = Shutdown()
        plan = ShutdownPlan.for_options(options)
        flushed: FlushResult | None = None
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                async for signum in signals:
                    first = not shutdown.requested.is_set()
                    log.info(
                        "%s: %s",
                        signal.Signals(signum).name,
                        "shutting down gracefully (again to exit now)" if first else "exiting now",
                    )
                    shutdown.request()
                    if first:
                        nursery.start_soon(_watchdog, plan.watchdog, 1)
                    else:
                        nursery.start_soon(_watchdog, plan.hard_exit_after, SECOND_SIGNAL_EXIT)

            nursery.start_soon(on_signals)
            try:
                pool = _pool_plan(options)
                worker: RunnableWorker | None = None
                make_tokenizer: Callable[[ModelInfo], Tokenizer] = _no_tokenizer
                if pool is None:
                    _, worker, make_tokenizer = _load_plan(options)
            except Exception as exc:  # a bad --model is a message, not a traceback
                log.error("cannot serve: %s", exc)
                nursery.cancel_scope.cancel()  # else the nursery waits for the signal task forever
                return 2
            on_rank_failure(worker, shutdown.request)  # a tensor-parallel rank failed: shut down, exit 1
            try:
                flushed = await run_server(
                    worker,
                    options=options,
                    make_tokenizer=make_tokenizer,
                    serve_http=partial(_serve_http, options, plan),
                    shutdown=shutdown,
                    plan=plan,
                    pool=pool,
                )
            except Exception as exc:
                failure = startup_failure(exc)
                if failure is None:
                    raise  # a crash while serving keeps its traceback
                # One line; the traceback only at --log-level debug.
                debug = log.isEnabledFor(logging.DEBUG)
                log.error("cannot serve: %s", failure.message, exc_info=exc if debug else None)
                nursery.cancel_scope.cancel()
                return failure.exit_code
            nursery.cancel_scope.cancel()
    log.info("bye")
    if shutdown.now.is_set():  # a second signal cut the drain (and the flush) short
        return SECOND_SIGNAL_EXIT
    # With the SSD tier, exit 0 only when the shutdown flush made everything durable.
    return 0 if (flushed is None or flushed.durable) and not rank_failed(worker) else 1


def _pool_plan(options: ServerOptions) -> PoolSetup | None:
    """With a model pool (--model-pool, --models-dir), its setup, which builds every model's
    worker and tokenizer; else None (`_load_plan` builds the one model's)."""
    from actors.options import pooled

    if not pooled(options):
        return None
    from actors.pool_setup import pool_setup

    return pool_setup(options)


def _no_tokenizer(info: ModelInfo) -> Tokenizer:
    raise AssertionError("a pool builds each model's tokenizer itself")


def _load_plan(options: ServerOptions) -> tuple[Path, RunnableWorker, Callable[[ModelInfo], Tokenizer]]:
    """The model directory, its worker (not yet loaded) and the tokenizer factory."""
    from actors.gpu_worker import GpuWorker
    from model.load.errors import ModelLoadError
    from model.text.tokenizer import Tokenizer

    names = options.model.served_model_name
    name = names[0] if names else None
    if options.model.model:
        from model.load.resolve import resolve_model_dir

        model_dir = Path(resolve_model_dir(options.model.model))
    else:
        from model.load.demo import DEMO_MODEL_NAME, ensure_demo_model

        name = name or DEMO_MODEL_NAME  # logged and served under one name, not its cache directory's
        log.info("no --model: using the embedded demo model, served as %s", name)
        model_dir = Path(ensure_demo_model())
    log.info("model directory: %s", model_dir)

    def make_tokenizer(info: ModelInfo) -> Tokenizer:
        try:
            return Tokenizer.from_dir(model_dir, eos_token_ids_from_config=info.eos_token_ids)
        except ValueError as exc:  # a malformed tokenizer.json / config / template: the directory's fault
            raise ModelLoadError(str(exc)) from exc

    if options.engine.isolate:  # the engine in a process of its own (actors/isolate/)
        from actors.isolate.worker import IsolatedWorker

        return model_dir, IsolatedWorker(model_dir, options, name=name), make_tokenizer
    return model_dir, GpuWorker(model_dir, options, name=name), make_tokenizer


async def _serve_http(
    options: ServerOptions, plan: ShutdownPlan, app: ASGIFramework, shutdown_trigger: Callable[[], Awaitable[None]]
) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from api.http.protocol_errors import install_protocol_errors

    install_protocol_errors()  # hypercorn's own 400/431 answers get a JSON error body
    hc = Config()
    hc.bind = [f"{options.http.host}:{options.http.port}"]
    if options.http.unix is not None:  # (actors/preflight.py replaced a stale file, refused a live one)
        hc.bind = [f"unix:{options.http.unix}"]
        hc.umask = 0o777 & ~options.http.unix_mode  # the file is created with --unix-mode, never wider
    hc.graceful_timeout = plan.http_deadline
    # Per-connection idle limit: a keep-alive connection (or one that never finishes its request
    # headers, which h11 caps at h11_max_incomplete_size = 16 KiB) closes after this long. The
    # timer is re-armed after each response only because api/http/connection.py shields the end of
    # the response from quart-trio's cancellation.
    # read_timeout stays None: a streaming client is silent for the whole generation, so a read
    # deadline would cut healthy streams. Slow bodies hit Quart's BODY_TIMEOUT (60 s, then 408);
    # body size is capped by --max-body-mb in the app (api/http/security.py).
    hc.keep_alive_timeout = options.http.idle_timeout
    hc.accesslog = None  # api/observability/request_log.py writes one structured line per request instead
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our handler, not a second one
    bound = False

    async def trigger() -> None:
        nonlocal bound
        bound = True  # (hypercorn awaits its trigger once its listeners are bound)
        await shutdown_trigger()

    try:
        await serve(app, hc, shutdown_trigger=trigger)
    finally:
        if options.http.unix is not None and bound:  # (a failed bind leaves another server's file alone)
            _remove_socket(options.http.unix)


def _remove_socket(path: str) -> None:
    """The --unix socket file goes with the server (a kill -9 leaves it: the next start replaces it)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


async def _watchdog(seconds: float, exit_code: int) -> None:
    import trio

    await trio.sleep(seconds)
    log.error("shutdown overran %.0f s (a client stopped reading?): exiting hard", seconds)
    logging.shutdown()
    os._exit(exit_code)


if __name__ == "__main__":
    sys.exit(main())

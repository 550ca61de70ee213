"""`python -m actors.serve`: the process entry point — flags, logging, signals, exit code.

The flags build one `ServeConfig` (actors/options.py); `--blas` and `--log-level` act before it
(MLX binds its BLAS when it loads). The signal receiver opens before anything else; the
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

import argparse
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

    from actors.options import ServeConfig
    from actors.root import RunnableWorker
    from actors.shutdown import ShutdownPlan
    from actors.worker_api import ModelInfo
    from model.tokenizer import Tokenizer

log = logging.getLogger("actors.serve")

# Flags whose parsed name differs from their ServeConfig field.
_FIELD_OF = {
    "memory_budget": "memory_budget_gb",
    "prompt_cache": "prompt_cache_gb",
    "ssd_cache": "ssd_cache_dir",
    "ssd_cache_max": "ssd_cache_max_gb",
    "ssd_spill_queue": "ssd_spill_queue_gb",
    "ssd_demote_idle": "ssd_demote_idle_s",
}
_PROCESS_FLAGS = {"blas", "log_level"}  # acted on before the server exists: no ServeConfig field
_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
SECOND_SIGNAL_EXIT = 130  # the shell's code for "ended by Ctrl-C": streams were cut, not finished
_PROG = "mlx-trio-server"  # the console script (pyproject.toml) that runs `main`


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`--help` has the usage), as every other start-up
    failure is; the exit code stays argparse's 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from actors.spec_flags import check_spec_flags

    return check_spec_flags(p := parser(), p.parse_args(argv))


def parser() -> argparse.ArgumentParser:
    from actors.feature_flags import add_feature_flags
    from actors.flag_types import (
        at_least_one,
        non_empty,
        non_negative_float,
        non_negative_int,
        path_arg,
        port_number,
        positive_float,
    )
    from actors.policy import parse_batch
    from actors.proxy_flags import add_proxy_flags

    p = _OneLineParser(
        prog=_PROG if Path(sys.argv[0]).name == _PROG else "python -m actors.serve",
        description="OpenAI-compatible LLM server on MLX (trio actors). No --model: the embedded demo model.",
    )
    p.add_argument("--model", type=path_arg, help="model directory or an org/name in the local Hugging Face cache")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=(),
        type=non_empty,
        metavar="NAME",
        help="names the model answers to; the first is used in replies and logs (default: org/name or directory name)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8080, help="0 = a free port the system picks")
    p.add_argument(
        "--batch",
        type=parse_batch,
        default=None,
        metavar="N|auto",
        help="max concurrent rows; 1 = strict serial executor (default auto: 32, fewer if their KV does not fit)",
    )
    p.add_argument("--max-tokens", type=at_least_one, default=None, help="default max_tokens for requests")
    p.add_argument(
        "--memory-budget",
        type=positive_float,
        default=None,
        metavar="GB",
        help="memory budget in decimal GB (default: 0.75 x device/system memory)",
    )
    p.add_argument("--max-queue", type=at_least_one, default=256, help="requests allowed to wait; more get 503")
    p.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM",
    )
    p.add_argument(
        "--prompt-cache",
        type=non_negative_float,
        default=8.0,
        metavar="GiB",
        help="RAM prompt cache size in GiB (default 8; 0 disables it)",
    )
    p.add_argument(
        "--ssd-cache",
        type=path_arg,
        default=None,
        metavar="DIR",
        help="keep prompt-cache entries on disk in DIR too, so they survive restarts (needs --prompt-cache > 0)",
    )
    p.add_argument(
        "--ssd-cache-max",
        type=positive_float,
        default=32.0,
        metavar="GiB",
        help="SSD cache size cap in GiB (default 32)",
    )
    p.add_argument(
        "--ssd-spill-queue",
        type=non_negative_float,
        default=2.0,
        metavar="GiB",
        help="write-behind queue cap in GiB; over it the oldest queued spill is dropped (default 2)",
    )
    p.add_argument(
        "--ssd-demote-idle",
        type=non_negative_float,
        default=300.0,
        metavar="S",
        help="move RAM entries unused this long to the SSD tier (default 300; 0 = off)",
    )
    p.add_argument(
        "--no-ssd-verify",
        dest="ssd_verify",
        action="store_false",
        help="skip the per-tensor hash check when restoring from the SSD tier",
    )
    p.add_argument(
        "--ssd-optional",
        action="store_true",
        help="an --ssd-cache directory that cannot be written or that another server holds is a warning "
        "and the server runs without the SSD tier (default: start-up fails, exit 2)",
    )
    p.add_argument(
        "--temp",
        type=non_negative_float,
        default=None,
        dest="temperature",
        help="default sampling temperature (default: generation_config.json, else 0 = greedy)",
    )
    p.add_argument("--top-p", type=non_negative_float, default=None, help="default top_p")
    p.add_argument("--top-k", type=int, default=None, help="default top_k (0 = off)")
    p.add_argument("--min-p", type=non_negative_float, default=None, help="default min_p")
    # Secrets may come from the environment so they stay out of `ps`.
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_TRIO_API_KEY") or None,
        help="require this key on /v1/* (Authorization: Bearer or x-api-key); env MLX_TRIO_API_KEY",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("MLX_TRIO_ADMIN_TOKEN") or None,
        help="require this token on every /admin/* and /v1/adapters* request, loopback included "
        "(without one: directly connected loopback clients only); env MLX_TRIO_ADMIN_TOKEN",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        dest="cors_origins",
        help="allow browser calls from ORIGIN (repeatable or comma-separated; * = any); default: CORS off",
    )
    add_proxy_flags(p)  # --allowed-hosts, --forwarded-allow-ips
    p.add_argument(
        "--max-body-mb",
        type=non_negative_float,
        default=16.0,
        metavar="MiB",
        help="request body cap in MiB, 413 above it (default 16; 0 = no cap)",
    )
    p.add_argument("--log-prompts", action="store_true", help="include prompt text in the per-request log lines")
    p.add_argument(
        "--log-level",
        choices=tuple(_LOG_LEVELS),
        default="info",
        help="log threshold; debug also prints the traceback of a start-up failure (default info)",
    )
    p.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--warm-up",
        choices=("auto", "on", "off"),
        default="auto",
        help="meet decode batch sizes 1..--batch once before serving (auto: on a GPU only)",
    )
    p.add_argument(
        "--group-prefill",
        choices=("auto", "on", "off"),
        default="auto",
        help="prefill simultaneous short arrivals in one forward (auto: on)",
    )
    p.add_argument(
        "--arrival-window-ms",
        type=non_negative_float,
        default=10.0,
        metavar="MS",
        help="with group prefill, a queue head waits up to MS for requests still being read "
        "and templated, so a burst shares one group prefill (default 10; 0 = off)",
    )
    p.add_argument(
        "--decoding-prefill-chunk",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="prefill a joining prompt N tokens at a time while other rows decode, so their "
        "streams wait for at most one such chunk between tokens (default: 512 on CPU, "
        "the full --prefill-chunk on a GPU; 0 = always the full chunk)",
    )
    add_feature_flags(p)
    p.add_argument(
        "--blas",
        type=path_arg,
        default="auto",
        metavar="auto|off|PATH",
        help="Linux CPU only: the BLAS MLX's CPU backend binds when it loads; auto = the first optimized "
        "one found (MKL, OpenBLAS, BLIS), off = MLX's bundled reference BLAS, or a library's path "
        "(default auto)",
    )
    return p


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The options object the parsed flags describe: every flag but --blas is one of its fields."""
    from actors.options import ServeConfig
    from api.security import parse_origins

    values = {_FIELD_OF.get(name, name): value for name, value in vars(args).items() if name not in _PROCESS_FLAGS}
    values["cors_origins"] = parse_origins(values["cors_origins"])
    return ServeConfig(**values)


def main(argv: Sequence[str] | None = None) -> int:
    """The process entry point (also the `mlx-trio-server` console script's); the exit code."""
    # Before any of our other packages is imported: one in the working directory would win.
    from actors.shadowing import shadowing_problem

    if problem := shadowing_problem():
        sys.stderr.write(f"cannot serve: {problem}\n")
        return 2
    args = parse_args(argv)
    logging.basicConfig(level=_LOG_LEVELS[args.log_level], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before anything can import mlx: MLX's CPU backend binds its BLAS at load time.
    from model.blas import preload_optimized_blas

    blas = preload_optimized_blas(args.blas)
    from actors.preflight import preflight
    from actors.startup import FAILURE_EXIT, USAGE_EXIT, StartupFailed

    try:
        config = preflight(serve_config(args))  # the paths, before the port or any weight
    except StartupFailed as exc:  # (the BLAS line would only bury this one)
        log.error("cannot serve: %s", exc.message, exc_info=exc if log.isEnabledFor(logging.DEBUG) else None)
        return USAGE_EXIT if exc.usage else FAILURE_EXIT
    log.info(blas.log_line())
    try:
        import trio

        return trio.run(_main, config)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was open (imports, startup)
        return 130


async def _main(config: ServeConfig) -> int:
    import trio

    from actors.messages import FlushResult
    from actors.root import run_server
    from actors.shutdown import Shutdown, ShutdownPlan
    from actors.startup import startup_failure
    from actors.tp_leader import on_rank_failure, rank_failed

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        shutdown = Shutdown()
        plan = ShutdownPlan.for_options(config)
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
                _, worker, make_tokenizer = _load_plan(config)
            except Exception as exc:  # a bad --model is a message, not a traceback
                log.error("cannot serve: %s", exc)
                nursery.cancel_scope.cancel()  # else the nursery waits for the signal task forever
                return 2
            on_rank_failure(worker, shutdown.request)  # a tensor-parallel rank failed: shut down, exit 1
            try:
                flushed = await run_server(
                    worker,
                    config=config,
                    make_tokenizer=make_tokenizer,
                    serve_http=partial(_serve_http, config, plan),
                    shutdown=shutdown,
                    plan=plan,
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


def _load_plan(config: ServeConfig) -> tuple[Path, RunnableWorker, Callable[[ModelInfo], Tokenizer]]:
    """The model directory, its worker (not yet loaded) and the tokenizer factory."""
    from actors.gpu_worker import GpuWorker
    from actors.policy import batch_rows
    from actors.speculation_setup import spec_choice
    from model.errors import ModelLoadError
    from model.tokenizer import Tokenizer

    name = config.served_model_name[0] if config.served_model_name else None
    if config.model:
        from model.resolve import resolve_model_dir

        model_dir = Path(resolve_model_dir(config.model))
    else:
        from model.demo import DEMO_MODEL_NAME, ensure_demo_model

        name = name or DEMO_MODEL_NAME  # logged and served under one name, not its cache directory's
        log.info("no --model: using the embedded demo model, served as %s", name)
        model_dir = Path(ensure_demo_model())
    log.info("model directory: %s", model_dir)

    def make_tokenizer(info: ModelInfo) -> Tokenizer:
        try:
            return Tokenizer.from_dir(model_dir, eos_token_ids_from_config=info.eos_token_ids)
        except ValueError as exc:  # a malformed tokenizer.json / config / template: the directory's fault
            raise ModelLoadError(str(exc)) from exc

    worker = GpuWorker(
        model_dir,
        name=name,
        prompt_cache_bytes=int(config.prompt_cache_gb * 2**30),
        cache_retention_share=config.cache_retention_share,
        ssd_cache_dir=config.ssd_cache_dir,
        ssd_cache_max_bytes=int(config.ssd_cache_max_gb * 2**30),
        ssd_verify=config.ssd_verify,
        ssd_optional=config.ssd_optional,
        warm_up_batch=partial(batch_rows, config),  # --batch auto is sized once the model is loaded
        warm_up=config.warm_up,
        engine_options=config.engine_options(),
        kv_quant=config.kv_quant,
        kv_group_size=config.kv_group_size,
        quantized_kv_start=config.quantized_kv_start,
        speculation=spec_choice(config),
        tensor_parallel=config.tensor_parallel,
    )
    return model_dir, worker, make_tokenizer


async def _serve_http(
    config: ServeConfig, plan: ShutdownPlan, app: ASGIFramework, shutdown_trigger: Callable[[], Awaitable[None]]
) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from api.protocol_errors import install_protocol_errors

    install_protocol_errors()  # hypercorn's own 400/431 answers get a JSON error body
    hc = Config()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.graceful_timeout = plan.http_deadline
    # Per-connection idle limit: a keep-alive connection (or one that never finishes its request
    # headers, which h11 caps at h11_max_incomplete_size = 16 KiB) closes after this long. The
    # timer is re-armed after each response only because api/connection.py shields the end of
    # the response from quart-trio's cancellation.
    # read_timeout stays None: a streaming client is silent for the whole generation, so a read
    # deadline would cut healthy streams. Slow bodies hit Quart's BODY_TIMEOUT (60 s, then 408);
    # body size is capped by --max-body-mb in the app (api/security.py).
    hc.keep_alive_timeout = config.idle_timeout
    hc.accesslog = None  # api/request_log.py writes one structured line per request instead
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our handler, not a second one
    await serve(app, hc, shutdown_trigger=shutdown_trigger)


async def _watchdog(seconds: float, exit_code: int) -> None:
    import trio

    await trio.sleep(seconds)
    log.error("shutdown overran %.0f s (a client stopped reading?): exiting hard", seconds)
    logging.shutdown()
    os._exit(exit_code)


if __name__ == "__main__":
    sys.exit(main())

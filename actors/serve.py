"""`python -m actors.serve`: the process entry point — flags, logging, signals, exit code.

The process shape follows trio-stack.md §1.5: the signal receiver opens before anything else;
the first SIGINT/SIGTERM starts the graceful shutdown (actors/root.py), the second cancels
everything; a wall-clock watchdog hard-exits if a client that stopped reading pins a
connection (hypercorn shields its socket writes, so no cancel can free it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

log = logging.getLogger("actors.serve")

WATCHDOG_SLACK_S = 10.0  # past the shutdown timeout + HTTP grace: only a stalled client is left


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m actors.serve",
        description="OpenAI-compatible LLM server on MLX (trio actors). No --model: the embedded demo model.",
    )
    p.add_argument("--model", help="model directory or an org/name in the local Hugging Face cache")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--batch", type=_at_least_one, default=8, help="max concurrent rows; 1 = strict serial executor")
    p.add_argument("--max-tokens", type=_at_least_one, default=None, help="default max_tokens for requests")
    p.add_argument("--memory-budget", type=_positive_float, default=None, metavar="GB",
                   help="memory budget in decimal GB (default: 0.75 x device/system memory)")
    p.add_argument("--max-queue", type=_at_least_one, default=256, help="requests allowed to wait; more get 503")
    p.add_argument("--shutdown-timeout", type=_positive_float, default=30.0, metavar="S",
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    p.add_argument("--prompt-cache", type=_non_negative_float, default=8.0, metavar="GiB",
                   help="RAM prompt cache size in GiB (default 8; 0 disables it)")
    p.add_argument("--temp", type=_non_negative_float, default=None, dest="temperature",
                   help="default sampling temperature (default: generation_config.json, else 0 = greedy)")
    p.add_argument("--top-p", type=_non_negative_float, default=None, help="default top_p")
    p.add_argument("--top-k", type=int, default=None, help="default top_k (0 = off)")
    p.add_argument("--min-p", type=_non_negative_float, default=None, help="default min_p")
    return p.parse_args(argv)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before anything can import mlx: MLX's CPU backend binds its BLAS at load time.
    try:
        from model.blas import preload_optimized_blas
    except ImportError:
        log.info("BLAS: model.blas not available; using MLX's bundled BLAS")
    else:
        log.info(preload_optimized_blas().log_line())
    try:
        import trio

        return trio.run(_main, args)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was open (imports, startup)
        return 130


async def _main(args: argparse.Namespace) -> int:
    import trio

    from actors.root import HTTP_GRACE_MARGIN_S, ServeConfig, Shutdown, run_server

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        shutdown = Shutdown()
        config = ServeConfig(
            model=args.model,
            host=args.host,
            port=args.port,
            batch=args.batch,
            max_tokens=args.max_tokens,
            memory_budget_gb=args.memory_budget,
            max_queue=args.max_queue,
            shutdown_timeout=args.shutdown_timeout,
            prompt_cache_gb=args.prompt_cache,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
        )
        async with trio.open_nursery() as nursery:

            async def on_signals() -> None:
                async for signum in signals:
                    first = not shutdown.requested.is_set()
                    log.info("%s: %s", signal.Signals(signum).name,
                             "shutting down gracefully (again to exit now)" if first else "exiting now")
                    shutdown.request()
                    if first:
                        budget = config.shutdown_timeout + HTTP_GRACE_MARGIN_S + WATCHDOG_SLACK_S
                        nursery.start_soon(_watchdog, budget)
                    else:
                        nursery.start_soon(_watchdog, 2.0)

            nursery.start_soon(on_signals)
            try:
                model_dir, worker, make_tokenizer = _load_plan(config)
            except Exception as exc:  # a bad --model is a message, not a traceback
                log.error("cannot serve: %s", exc)
                return 2
            await run_server(
                worker,
                config=config,
                make_tokenizer=make_tokenizer,
                serve_http=partial(_serve_http, config),
                shutdown=shutdown,
            )
            nursery.cancel_scope.cancel()
    log.info("bye")
    return 0


def _load_plan(config):  # type: ignore[no-untyped-def]
    """The model directory, its worker (not yet loaded) and the tokenizer factory."""
    from actors.gpu_worker import GpuWorker
    from model.tokenizer import Tokenizer

    if config.model:
        from model.resolve import resolve_model_dir

        model_dir = resolve_model_dir(config.model)
    else:
        from model.demo import DEMO_MODEL_NAME, ensure_demo_model

        log.info("no --model: serving %s", DEMO_MODEL_NAME)
        model_dir = ensure_demo_model()
    log.info("model directory: %s", model_dir)

    def make_tokenizer(info):  # type: ignore[no-untyped-def]
        return Tokenizer.from_dir(Path(model_dir), eos_token_ids_from_config=info.eos_token_ids)

    worker = GpuWorker(Path(model_dir), prompt_cache_bytes=int(config.prompt_cache_gb * 2**30))
    return model_dir, worker, make_tokenizer


async def _serve_http(config, app, shutdown_trigger) -> None:  # type: ignore[no-untyped-def]
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from actors.root import HTTP_GRACE_MARGIN_S

    hc = Config()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.graceful_timeout = config.shutdown_timeout + HTTP_GRACE_MARGIN_S
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our handler, not a second one
    log.info("serving on http://%s:%d (OpenAI API at /v1)", config.host, config.port)
    await serve(app, hc, shutdown_trigger=shutdown_trigger)


async def _watchdog(seconds: float) -> None:
    import trio

    await trio.sleep(seconds)
    log.error("shutdown overran %.0f s (a client stopped reading?): exiting hard", seconds)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())

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
    p.add_argument(
        "--memory-budget",
        type=_positive_float,
        default=None,
        metavar="GB",
        help="memory budget in decimal GB (default: 0.75 x device/system memory)",
    )
    p.add_argument("--max-queue", type=_at_least_one, default=256, help="requests allowed to wait; more get 503")
    p.add_argument(
        "--shutdown-timeout",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM",
    )
    p.add_argument(
        "--prompt-cache",
        type=_non_negative_float,
        default=8.0,
        metavar="GiB",
        help="RAM prompt cache size in GiB (default 8; 0 disables it)",
    )
    # Issue 7: the prompt cache's SSD tier (docs/ssd-cache.md).
    p.add_argument(
        "--ssd-cache",
        default=None,
        metavar="DIR",
        help="keep prompt-cache entries on disk in DIR too, so they survive restarts (needs --prompt-cache > 0)",
    )
    p.add_argument(
        "--ssd-cache-max",
        type=_positive_float,
        default=32.0,
        metavar="GiB",
        help="SSD cache size cap in GiB (default 32)",
    )
    p.add_argument(
        "--ssd-spill-queue",
        type=_non_negative_float,
        default=2.0,
        metavar="GiB",
        help="write-behind queue cap in GiB; over it the oldest queued spill is dropped (default 2)",
    )
    p.add_argument(
        "--ssd-demote-idle",
        type=_non_negative_float,
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
        "--temp",
        type=_non_negative_float,
        default=None,
        dest="temperature",
        help="default sampling temperature (default: generation_config.json, else 0 = greedy)",
    )
    p.add_argument("--top-p", type=_non_negative_float, default=None, help="default top_p")
    p.add_argument("--top-k", type=int, default=None, help="default top_k (0 = off)")
    p.add_argument("--min-p", type=_non_negative_float, default=None, help="default min_p")
    # Issue 9: access, limits, logs (api/security.py). Secrets may come from the environment so
    # they stay out of `ps`.
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_TRIO_API_KEY") or None,
        help="require this key on /v1/* (Authorization: Bearer or x-api-key); env MLX_TRIO_API_KEY",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("MLX_TRIO_ADMIN_TOKEN") or None,
        help="let non-loopback clients call /admin/* with this token; env MLX_TRIO_ADMIN_TOKEN",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        dest="cors_origins",
        help="allow browser calls from ORIGIN (repeatable or comma-separated; * = any); default: CORS off",
    )
    p.add_argument(
        "--max-body-mb",
        type=_non_negative_float,
        default=16.0,
        metavar="MiB",
        help="request body cap in MiB, 413 above it (default 16; 0 = no cap)",
    )
    p.add_argument("--log-prompts", action="store_true", help="include prompt text in the per-request log lines")
    p.add_argument(
        "--idle-timeout",
        type=_positive_float,
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
        type=_non_negative_float,
        default=10.0,
        metavar="MS",
        help="with group prefill, a queue head waits up to MS for requests still being read "
        "and templated, so a burst shares one group prefill (default 10; 0 = off)",
    )
    p.add_argument(
        "--decoding-prefill-chunk",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="prefill a joining prompt N tokens at a time while other rows decode, so their "
        "streams wait for at most one such chunk between tokens (default: 512 on CPU, "
        "the full 2048-token chunk on a GPU; 0 = always the full chunk)",
    )
    p.add_argument(
        "--prefill-bucket",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="right-pad a request's prefill to a multiple of N tokens so CUDA attention graphs "
        "are reused (first prompt of a new length ~60 ms faster on an H200); greedy "
        "tokens may then differ from mlx-lm's in the last bits (default 0 = exact widths)",
    )
    return p.parse_args(argv)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


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

    from actors.options import ServeConfig
    from actors.root import HTTP_GRACE_MARGIN_S, run_server
    from actors.shutdown import Shutdown
    from api.security import parse_origins

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
            ssd_cache_dir=args.ssd_cache,
            ssd_cache_max_gb=args.ssd_cache_max,
            ssd_spill_queue_gb=args.ssd_spill_queue,
            ssd_demote_idle_s=args.ssd_demote_idle,
            ssd_verify=args.ssd_verify,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            api_key=args.api_key,
            admin_token=args.admin_token,
            cors_origins=parse_origins(args.cors_origins),
            max_body_mb=args.max_body_mb,
            log_prompts=args.log_prompts,
            idle_timeout=args.idle_timeout,
            warm_up=args.warm_up,
            group_prefill=args.group_prefill,
            prefill_bucket=args.prefill_bucket,
            decoding_prefill_chunk=args.decoding_prefill_chunk,
            arrival_window_ms=args.arrival_window_ms,
        )
        flushed = None
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
                        budget = config.shutdown_timeout + HTTP_GRACE_MARGIN_S + WATCHDOG_SLACK_S
                        if config.ssd_cache_dir:
                            budget += config.shutdown_timeout  # the durability flush's own budget
                        nursery.start_soon(_watchdog, budget)
                    else:
                        nursery.start_soon(_watchdog, 2.0)

            nursery.start_soon(on_signals)
            if config.ssd_cache_dir and config.prompt_cache_gb <= 0:
                log.error("cannot serve: --ssd-cache requires the RAM prompt cache (--prompt-cache 0 disables it)")
                nursery.cancel_scope.cancel()  # else the nursery waits for the signal task forever
                return 2
            try:
                model_dir, worker, make_tokenizer = _load_plan(config)
            except Exception as exc:  # a bad --model is a message, not a traceback
                log.error("cannot serve: %s", exc)
                nursery.cancel_scope.cancel()
                return 2
            flushed = await run_server(
                worker,
                config=config,
                make_tokenizer=make_tokenizer,
                serve_http=partial(_serve_http, config),
                shutdown=shutdown,
            )
            nursery.cancel_scope.cancel()
    log.info("bye")
    # With the SSD tier, exit 0 only when the shutdown flush made everything durable.
    return 0 if flushed is None or flushed.durable else 1


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

    worker = GpuWorker(
        Path(model_dir),
        prompt_cache_bytes=int(config.prompt_cache_gb * 2**30),
        ssd_cache_dir=config.ssd_cache_dir,
        ssd_cache_max_bytes=int(config.ssd_cache_max_gb * 2**30),
        ssd_verify=config.ssd_verify,
        warm_up_batch=config.batch,
        warm_up=config.warm_up,
        prefill_bucket=config.prefill_bucket,
    )
    return model_dir, worker, make_tokenizer


async def _serve_http(config, app, shutdown_trigger) -> None:  # type: ignore[no-untyped-def]
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from actors.root import HTTP_GRACE_MARGIN_S

    hc = Config()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.graceful_timeout = config.shutdown_timeout + HTTP_GRACE_MARGIN_S
    # Per-connection idle limit: a keep-alive connection (or one that never finishes its request
    # headers, which h11 caps at h11_max_incomplete_size = 16 KiB) closes after this long.
    # read_timeout stays None: a streaming client is silent for the whole generation, so a read
    # deadline would cut healthy streams. Slow bodies hit Quart's BODY_TIMEOUT (60 s, then 408);
    # body size is capped by --max-body-mb in the app (api/security.py).
    hc.keep_alive_timeout = config.idle_timeout
    hc.accesslog = None  # api/request_log.py writes one structured line per request instead
    hc.errorlog = logging.getLogger("hypercorn.error")  # through our handler, not a second one
    log.info("serving on http://%s:%d (OpenAI API at /v1)", config.host, config.port)
    if not getattr(config, "api_key", None) and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach this port can use /v1", config.host)
    await serve(app, hc, shutdown_trigger=shutdown_trigger)


async def _watchdog(seconds: float) -> None:
    import trio

    await trio.sleep(seconds)
    log.error("shutdown overran %.0f s (a client stopped reading?): exiting hard", seconds)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())

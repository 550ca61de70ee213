"""`python -m actors.tp.follower`: one tensor-parallel follower rank, started by the server.

The server (rank 0, actors/tp/leader.py) starts N-1 of these with MLX's ring-backend environment
(the rank and the hostfile, read by `mx.distributed.init` itself). A follower loads the same model,
joins the ring, keeps its shard (model/nn/tensor_parallel.py) and builds the same engine; then it
repeats every engine call rank 0 sends over stdin, in order, and acknowledges each on stdout with
the digest of its result (actors/tp/link.py). Both ranks' forwards meet in the collectives of the
row-parallel layers; the follower's tokens are never used, only compared.

Its life is rank 0's: it ignores SIGINT/SIGTERM (a terminal's Ctrl-C reaches the whole process
group; the server decides), exits 0 on `Stop`, and exits 1 on EOF (the server died) or when
anything fails. Its logs go to stderr; stdout carries only acknowledgements.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import IO, Any

from actors.tp.link import BROADCAST, Ack, Call, Setup, Stop, digest, error_text, receive, send

log = logging.getLogger("actors.tp.follower")


def main() -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    # The acknowledgements get the real stdout; anything else printing there goes to stderr.
    acks = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    commands = sys.stdin.buffer
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        setup = receive(commands)
        engine, rank = _build(setup)
    except EOFError:
        return 1
    except Exception as exc:
        log.exception("tensor-parallel follower failed to start")
        send(acks, Ack(False, error=error_text(exc)))
        return 1
    send(acks, Ack(True, engine.model.kv_bytes_per_token(engine.model.activation_dtype().size)))
    log.info("tensor-parallel rank %d ready", rank)
    return _serve(engine, commands, acks)


def _build(setup: Setup) -> tuple[Any, int]:
    import mlx.core as mx

    from model.engine.build import build_engine, kv_scheme_for
    from model.load.loader import load_model
    from model.nn.tensor_parallel import check_shardable, shard_model

    loaded = load_model(setup.model_dir)
    group = mx.distributed.init(strict=True, backend="ring")
    check_shardable(loaded.model, group.size())
    shard_model(loaded.model, group)  # type: ignore[arg-type]  # (checked: a DecoderModel)
    built = build_engine(
        loaded,
        engine=setup.engine_options,
        kv_scheme=kv_scheme_for(loaded, setup.kv),
        eos_token_ids=setup.eos_token_ids,
        protected_ids=setup.protected_ids,
    )
    return built.engine, group.rank()


def _serve(engine: Any, commands: IO[bytes], acks: IO[bytes]) -> int:
    while True:
        try:
            message = receive(commands)
        except EOFError:
            log.error("the server's control pipe closed: exiting")
            return 1
        if isinstance(message, Stop):
            return 0
        if not isinstance(message, Call) or message.method not in BROADCAST:
            log.error("unexpected control message %r: exiting", message)
            return 1
        try:
            result = getattr(engine, message.method)(*message.args, **dict(message.kwargs))
        except Exception as exc:  # rank 0 raised the same, or the ranks have drifted: it decides
            ack = Ack(False, error=error_text(exc))
        else:
            ack = Ack(True, digest(result))
        try:
            send(acks, ack)
        except OSError:
            return 1


if __name__ == "__main__":
    sys.exit(main())

"""Start-up failures as one line a user can act on, instead of a nested ExceptionGroup traceback.

The root (actors/root.py) raises `StartupFailed` when the port cannot be bound or the server
cannot be built (model load, tokenizer, SSD tier); trio wraps it in the nurseries' exception
groups on its way out, and the entry point (actors/serve.py) finds it with `startup_failure`.
A failure the command line caused — a bad --model directory, an unsupported model_type, missing
weights, a busy or forbidden port, an SSD cache directory another server holds — is a usage
error (exit 2); any other start-up failure exits 1. Either way the log gets one line, plus the
traceback at --log-level debug.
"""

from __future__ import annotations

import attrs

from cache.ssd_store import SsdUnavailable
from model.load.errors import ModelLoadError

USAGE_EXIT = 2  # argparse's own exit code for a bad command line
FAILURE_EXIT = 1


class StartupFailed(Exception):
    """The server could not start; `message` is the one line to show."""

    def __init__(self, message: str, *, usage: bool) -> None:
        super().__init__(message)
        self.message = message
        self.usage = usage


def listen_failed(host: str, port: int, error: BaseException, *, unix: str | None = None) -> StartupFailed:
    """A bind error out of hypercorn (possibly inside its nurseries' exception groups); `unix`:
    the socket path it was binding instead of host:port."""
    where = f"unix:{unix}" if unix is not None else f"{host}:{port}"
    cause = find(error, OSError)
    if not isinstance(cause, OSError):
        return StartupFailed(f"cannot listen on {where}: {error}", usage=False)
    return StartupFailed(f"cannot listen on {where}: {cause.strerror or cause}", usage=True)


def load_failed(model: str | None, error: BaseException) -> StartupFailed:
    """A failure while the model loads or the actors start."""
    failed = find(error, StartupFailed)  # already one line (a bad --adapter, say)
    if isinstance(failed, StartupFailed):
        return failed
    usage = find(error, (ModelLoadError, SsdUnavailable))
    if usage is not None:
        # The model layer's messages are one line and usually name the directory already.
        where = model or "(demo)"
        return StartupFailed(str(usage) if where in str(usage) else f"{where}: {usage}", usage=True)
    leaf = find(error, Exception) or error
    return StartupFailed(f"start-up failed: {type(leaf).__name__}: {leaf}", usage=False)


@attrs.frozen
class Failure:
    message: str
    exit_code: int


def startup_failure(error: BaseException) -> Failure | None:
    """The start-up failure inside `error` (an exception group or not), or None when `error` is
    something else (a crash while serving: that one keeps its traceback)."""
    failed = find(error, StartupFailed)
    if not isinstance(failed, StartupFailed):
        return None
    return Failure(failed.message, USAGE_EXIT if failed.usage else FAILURE_EXIT)


def find(error: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `kind` in `error`, its exception groups and its causes."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        exc = stack.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, kind) and not isinstance(exc, BaseExceptionGroup):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        if exc.__cause__ is not None:
            stack.append(exc.__cause__)
    return None

"""Start-up checks of the command line's paths, before anything loads.

`python -m actors.serve` runs `preflight(options)` after the flags are parsed (and their rules
across flags checked, actors/options.py `validate`) and before the port is bound or a weight is
read, so a mistake a user can fix costs them under a second and one line (`StartupFailed`,
usage: exit 2; actors/startup.py):

* a `--model` that does not resolve, whose config.json is missing or names an unsupported
  `model_type`, or whose tokenizer (tokenizer.json, tokenizer_config.json, the chat template)
  is missing or does not load (the loader would read gigabytes of weights first and then fail);
* a `--chat-template` file that cannot be read or does not compile;
* an `--ssd-cache` directory that cannot be created or written — unless `--ssd-optional`, which
  makes it a warning and serves without the SSD tier (the options returned have none);
* a `--response-store` directory that cannot be created or written;
* a `--unix` socket path whose directory is missing, that is too long for a socket address, that
  is some other kind of file, or where another server is listening (a socket file nobody listens
  on is a dead server's: hypercorn replaces it).

A model without a chat template is a warning, not a failure: /v1/completions still works. An SSD
directory another server holds is found only once the model is loaded (the lock is per model
identity, which needs the weights): the GPU worker fails start-up the same way then.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

import attrs

from actors.ssd.response_records import dir_problem
from actors.startup import StartupFailed
from model.options import ServerOptions

log = logging.getLogger(__name__)

SSD_OPTIONAL_HINT = "pass --ssd-optional to serve without the SSD tier"


def preflight(options: ServerOptions) -> ServerOptions:
    """`options` once its paths are usable (possibly without its SSD tier, with --ssd-optional);
    raises StartupFailed (usage) naming the first problem."""
    if options.model.model:
        check_model_dir(options.model.model)
    if options.templates.chat_template is not None:
        check_template_file(options.templates.chat_template)
    if options.http.unix is not None and (problem := unix_socket_problem(Path(options.http.unix))):
        raise StartupFailed(problem, usage=True)
    store = options.responses.response_store
    if store not in (None, "memory") and (problem := dir_problem(Path(store))):
        raise StartupFailed(problem, usage=True)
    caches = options.caches
    if caches.ssd_cache_dir and (problem := ssd_dir_problem(Path(caches.ssd_cache_dir))):
        if not caches.ssd_optional:
            raise StartupFailed(f"{problem}; {SSD_OPTIONAL_HINT}", usage=True)
        log.warning("SSD cache disabled (--ssd-optional): %s", problem)
        return attrs.evolve(options, caches=attrs.evolve(caches, ssd_cache_dir=None))
    return options


def check_template_file(path: str) -> None:
    """`--chat-template` reads and compiles (its syntax errors name the line)."""
    from model.text.tokenizer import read_template_file

    try:
        read_template_file(path)
    except ValueError as exc:
        raise StartupFailed(str(exc), usage=True) from exc


def check_model_dir(spec: str) -> Path:
    """The directory `--model` names, once its config and tokenizer load; warns when it has no
    chat template. Imports MLX (the families): the BLAS must be bound first. The tokenizer is
    loaded once more after the weights (a fraction of a second even for a 150k vocabulary)."""
    from model.families import family_for
    from model.load.config import load_config
    from model.load.embedding_config import read_pooling
    from model.load.errors import ModelLoadError
    from model.load.resolve import resolve_model_dir
    from model.text.tokenizer import TOKENIZER_FILE, Tokenizer

    try:
        model_dir = resolve_model_dir(spec)
        family_for(load_config(model_dir).model_type)
        if not (model_dir / TOKENIZER_FILE).is_file():
            raise ModelLoadError(
                f"{model_dir}: no {TOKENIZER_FILE} (the server reads a model's tokenizer only from "
                f"{TOKENIZER_FILE}: copy it from the model's original repository)"
            )
        try:
            tokenizer = Tokenizer.from_dir(model_dir)  # its files name their own path when bad
        except ValueError as exc:  # (a template's syntax error included: TemplateError)
            raise ModelLoadError(str(exc)) from exc
        embedding = read_pooling(model_dir, 0) is not None
    except ModelLoadError as exc:
        raise StartupFailed(str(exc), usage=True) from exc
    if not embedding and not tokenizer.has_chat_template:
        log.warning(
            "%s has no chat template: /v1/chat/completions, /v1/messages and /v1/responses will answer 400, "
            "only /v1/completions works; to chat, add the model's template to its directory "
            '(chat_template.jinja, or "chat_template" in tokenizer_config.json)',
            model_dir,
        )
    return model_dir


def ssd_dir_problem(root: Path) -> str | None:
    """Why the SSD tier could not keep files under `root`, or None: the directory is created if
    missing and a file is written and removed there (a read-only mount or a file in the way
    fails here, not on the first spill)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".mlx-trio-probe-"):
            pass
    except OSError as exc:
        return f"--ssd-cache {root} is not a writable directory ({exc.strerror or exc})"
    return None


UNIX_PATH_MAX = 107  # bytes of a socket path sockaddr_un holds (108 on Linux, 104 on macOS, with the NUL)


def unix_socket_problem(path: Path) -> str | None:
    """Why the server cannot listen on the unix socket `path`, or None. A socket file that refuses
    connections is a dead server's (a kill -9 leaves it): binding replaces it."""
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        return f"--unix {path}: the path is too long for a unix socket (at most {UNIX_PATH_MAX} bytes)"
    if not path.parent.is_dir():
        return f"--unix {path}: the directory {path.parent} does not exist"
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return f"--unix {path}: the file exists and is not a socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return None  # stale
        except OSError as exc:
            return f"--unix {path}: {exc.strerror or exc}"
    return f"--unix {path}: another server is listening on it"

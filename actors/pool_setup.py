"""What a pooled server is built from (actors/pool.py): the catalog of servable models, the one MLX
thread they share, and for each model its options, its GPU worker and its tokenizer.

The `--model` (the default) is served as the flags say. Every other model gets the same flags
minus what names one model's files: `--served-model-name` (it is served under its own id), the
`--adapter`s and `--default-adapter` (LoRA weights fit one base model), and `--chat-template`
(a template file is written for one model's tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from actors.gpu_worker import GpuWorker
from actors.isolate.worker import IsolatedWorker
from actors.mlx_thread import MlxThread
from actors.model_catalog import ModelCatalog, Servable, default_model
from actors.worker_api import ModelInfo
from model.load.errors import ModelLoadError
from model.options import ServerOptions

if TYPE_CHECKING:
    from model.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class PoolSetup:
    options: ServerOptions
    catalog: ModelCatalog
    thread: MlxThread = attrs.Factory(MlxThread)

    def options_for(self, model: Servable) -> ServerOptions:
        """The default model's options are the flags; another's drop what names the default's files."""
        if model == self.catalog.default:
            return self.options
        o = self.options
        return attrs.evolve(
            o,
            model=attrs.evolve(o.model, model=str(model.path), served_model_name=(model.id,)),
            adapters=attrs.evolve(o.adapters, adapters=(), default_adapter=None),
            templates=attrs.evolve(o.templates, chat_template=None),
        )

    def worker(self, model: Servable) -> tuple[GpuWorker | IsolatedWorker, Callable[[ModelInfo], Tokenizer]]:
        """The model's worker on the shared MLX thread (not loaded yet) and its tokenizer factory;
        under --isolate, its engine in a process of its own (actors/isolate/), so it dies alone."""
        from model.text.tokenizer import Tokenizer

        options = self.options_for(model)
        worker: GpuWorker | IsolatedWorker
        if options.engine.isolate:
            worker = IsolatedWorker(model.path, options, name=model.id)
        else:
            worker = GpuWorker(model.path, options, name=model.id, thread=self.thread)

        def make_tokenizer(info: ModelInfo) -> Tokenizer:
            try:
                return Tokenizer.from_dir(model.path, eos_token_ids_from_config=info.eos_token_ids)
            except ValueError as exc:  # a malformed tokenizer.json / config / template: the directory's fault
                raise ModelLoadError(str(exc)) from exc

        return worker, make_tokenizer


def pool_setup(options: ServerOptions) -> PoolSetup:
    """The pool's catalog for `options` (ModelLoadError: the --model does not resolve)."""
    names = options.model.served_model_name
    models_dir = None if options.model.models_dir is None else Path(options.model.models_dir).expanduser()
    default = default_model(options.model.model, names[0] if names else None, models_dir)
    aliases: list[str] = [*names]
    if options.model.model:
        aliases += [options.model.model, str(Path(options.model.model).expanduser())]
        if default is not None:
            aliases.append(str(default.path))
    if default is None:  # no --model and no model under --models-dir: the demo model, as without a pool
        from model.load.demo import DEMO_MODEL_NAME, ensure_demo_model

        log.info("no --model: the embedded demo model is the pool's default")
        default = Servable(names[0] if names else DEMO_MODEL_NAME, Path(ensure_demo_model()))
    aliases.append("default_model")  # mlx_lm.server's name for the model it started with
    log.info(
        "model pool: up to %d resident; default %s (%s)%s",
        options.model.model_pool,
        default.id,
        default.path,
        f"; models from {models_dir}" if models_dir is not None else "",
    )
    return PoolSetup(options, ModelCatalog(default, aliases=aliases, models_dir=models_dir))

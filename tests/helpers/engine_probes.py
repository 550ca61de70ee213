"""Engine doubles that record what a forward saw."""

from __future__ import annotations


class WidthRecorder:
    """Wraps a model: records every forward's (batch, width), delegates everything else."""

    def __init__(self, model):
        self._model = model
        self.widths: list[tuple[int, int]] = []

    def __call__(self, tokens, caches, **kwargs):
        self.widths.append(tuple(tokens.shape))
        return self._model(tokens, caches, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)

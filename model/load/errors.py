"""The one error type the model layer raises for a directory it cannot serve."""


class ModelLoadError(Exception):
    """A model directory cannot be loaded. The message is one line a user can act on."""

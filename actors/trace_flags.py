"""The tracing flag: `--otlp-endpoint URL` (fills `ServeConfig.otlp_endpoint`; api/tracing.py).

The flag needs the optional OpenTelemetry packages (`pip install 'mlx-trio-server[otel]'`); when
they are missing the server stops at once, before loading anything, with one line (exit 2).
Nothing here imports OpenTelemetry unless the flag is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections.abc import Sequence
from typing import Any

INSTALL_HINT = "pip install 'mlx-trio-server[otel]'"
# What the exporter needs: the SDK and its OTLP/HTTP exporter.
NEEDED_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
_URL = re.compile(r"https?://[^/\s]+\S*")


def add_trace_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--otlp-endpoint",
        type=otlp_url,
        action=_NeedsOtel,
        default=None,
        metavar="URL",
        help="trace every request with OpenTelemetry and export the spans over OTLP/HTTP to the "
        "collector at URL (its base URL, e.g. http://localhost:4318: /v1/traces is appended); "
        "the standard OTEL_EXPORTER_OTLP_ENDPOINT does the same when this is not given. Needs "
        f"{INSTALL_HINT} (default: off)",
    )


def otlp_url(text: str) -> str:
    if not _URL.fullmatch(text):
        raise argparse.ArgumentTypeError("must be an http:// or https:// URL")
    return text


def otel_installed() -> bool:
    try:
        return all(importlib.util.find_spec(name) is not None for name in NEEDED_MODULES)
    except ImportError:  # a parent package missing
        return False


class _NeedsOtel(argparse.Action):
    """Stores the URL once the packages are there; else one line and exit 2 (no usage block)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if not otel_installed():
            parser.exit(2, f"{parser.prog}: error: {option_string} needs OpenTelemetry: {INSTALL_HINT}\n")
        setattr(namespace, self.dest, values)

"""The chat page's flag: `--no-ui` fills `ServeConfig.ui` (False: `GET /` and `/ui/*` answer 404;
api/ui_routes.py)."""

from __future__ import annotations

import argparse


def add_ui_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the chat page at GET / (the API is unchanged; default: the page is served, "
        "and asks for --api-key in the browser when one is set)",
    )

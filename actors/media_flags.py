"""The image-decoding memory flags (api/media.py): `--media-memory` fills
`ServeConfig.media_memory_gb`, `--media-request-memory` `ServeConfig.media_request_memory_gb`."""

from __future__ import annotations

import argparse

from actors.flag_types import positive_float

DEFAULT_MEDIA_MEMORY_GIB = 4.0
DEFAULT_MEDIA_REQUEST_MEMORY_GIB = 3.0


def add_media_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--media-memory",
        dest="media_memory_gb",
        type=positive_float,
        default=DEFAULT_MEDIA_MEMORY_GIB,
        metavar="GiB",
        help="memory that decoding requests' images may take at once; an image request that "
        "does not fit waits for earlier ones (default 4)",
    )
    p.add_argument(
        "--media-request-memory",
        dest="media_request_memory_gb",
        type=positive_float,
        default=DEFAULT_MEDIA_REQUEST_MEMORY_GIB,
        metavar="GiB",
        help="memory that decoding one request's images may take (at most --media-memory); a "
        "request over it gets 400 images_too_large (default 3)",
    )

"""Opening the prompt cache's SSD tier, on the GPU worker's thread once the model is loaded (the
tier's directory is named by the model's identity: its weights' fingerprint, KV dtype and
tokenizer).

A tier that cannot open — another server holds its directory, a write fails — fails start-up in
one line (`StartupFailed`, exit 2): the user asked for it with `--ssd-cache`. With
`--ssd-optional` it is a warning and the server runs on the RAM tier alone, as it did before the
flag existed. (A directory that cannot be written at all is caught earlier, before the model
loads: actors/preflight.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from actors.preflight import SSD_OPTIONAL_HINT
from actors.startup import StartupFailed

if TYPE_CHECKING:
    from cache.ssd_store import SsdStore
    from model.load.loader import LoadedModel

log = logging.getLogger(__name__)


def open_ssd_store(root: Path, loaded: LoadedModel, *, max_bytes: int, verify: bool, optional: bool) -> SsdStore | None:
    """The opened store under `root` for `loaded`, or None when it cannot open and `optional`."""
    from cache.ssd_identity import Identity, model_fingerprint, scheme_key, tokenizer_hash
    from cache.ssd_store import SsdStore

    try:
        identity = Identity(
            model_id=loaded.name,
            fingerprint=model_fingerprint(loaded.path),
            scheme=scheme_key(str(loaded.kv_dtype).rsplit(".", 1)[-1]),
            tokenizer_hash=tokenizer_hash(loaded.path),
        )
        return SsdStore(root, identity, max_bytes=max_bytes, verify=verify).open()
    except Exception as e:  # noqa: BLE001 - whatever the cause, the tier is unusable
        if not optional:
            raise StartupFailed(f"--ssd-cache: {e}; {SSD_OPTIONAL_HINT}", usage=True) from e
        log.warning("SSD cache disabled (--ssd-optional): %s", e)
        return None

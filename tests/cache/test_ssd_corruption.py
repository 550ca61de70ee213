"""Flipped bytes in a stored file: always a miss + quarantine, never a wrong token.

One entry is written once; each case copies it, damages one byte, opens a fresh store (the
start-up scan verifies headers) and runs the next turn on a fresh tiered engine (the restore
verifies tensor hashes). The output must equal the cold run every time.
"""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from cache.ssd_store import QUARANTINE, SsdStore
from model.load.loader import load_model
from tests.helpers.ssd_store import PROMPT, cold, identity_of, open_store, run, store_prompt, tiered_engine


@pytest.fixture(scope="module")
def loaded(qwen3_dir):
    return load_model(qwen3_dir)


@pytest.fixture(scope="module")
def stored(loaded, tmp_path_factory):
    """(pristine store dir, entry file name, header length, turn-2 prompt, cold output)."""
    root = tmp_path_factory.mktemp("pristine")
    store = open_store(root, loaded)
    tokens, first = store_prompt(loaded, store)
    store.close()
    path = store.entries()[0].path
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    turn2 = PROMPT + tuple(first) + (11, 12, 13)
    return root, path.relative_to(root), n, turn2, cold(loaded, turn2)


def damaged_copy(stored, tmp_path, offset: int):
    root, rel, *_ = stored
    copy = tmp_path / "ssd"
    shutil.copytree(root, copy)
    path = copy / rel
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))
    return copy, path


def check_is_a_miss(loaded, stored, root, path):
    turn2, expected = stored[3], stored[4]
    store = open_store(root, loaded)
    engine, cache = tiered_engine(loaded, store)
    cached, out = run(engine, turn2)
    assert out == expected, "a damaged entry changed the output"
    assert cache.restores == 0 and cached == 0
    assert not path.exists() and len(store) == 0
    assert len(list((store.dir / QUARANTINE).iterdir())) == 1
    store.close()


@pytest.mark.parametrize("where", [0.1, 0.3, 0.5, 0.7, 0.9, 0.999])
def test_a_flipped_tensor_byte_is_a_miss_and_is_quarantined(loaded, stored, tmp_path, where):
    root, rel, n, *_ = stored
    size = (root / rel).stat().st_size
    data_start = 8 + n
    root2, path = damaged_copy(stored, tmp_path, data_start + int((size - data_start) * where))
    scanned = open_store(root2, loaded)
    assert len(scanned) == 1  # the header is intact: only the restore's hash check can tell
    scanned.close()
    check_is_a_miss(loaded, stored, root2, path)


@pytest.mark.parametrize("where", ["length", "tokens", "tensor table", "padding"])
def test_a_flipped_header_byte_is_quarantined_at_start_up(loaded, stored, tmp_path, where):
    root, rel, n, *_ = stored
    raw = (root / rel).read_bytes()
    body_end = 8 + len(raw[8 : 8 + n].rstrip(b" "))
    assert 8 + n - body_end > 2  # the header is padded to a page
    offsets = {
        "length": 2,
        "tokens": raw.index(b'tokens\\":[', 8) + 12,
        "tensor table": raw.index(b'"data_offsets":[', 8) + 17,
        "padding": (body_end + 8 + n) // 2,
    }
    root2, path = damaged_copy(stored, tmp_path, offsets[where])
    store = SsdStore(root2, identity_of(loaded), max_bytes=1 << 30, verify=False).open()  # even unverified
    assert len(store) == 0 and store.stats.quarantined == 1 and not path.exists()
    store.close()
    check_is_a_miss(loaded, stored, root2, path)


def test_random_flips_anywhere_never_change_a_token(loaded, stored, tmp_path):
    root, rel, n, turn2, expected = stored
    size = (root / rel).stat().st_size
    rng = np.random.default_rng(3)
    for i, offset in enumerate(rng.integers(0, size, 12)):
        case = tmp_path / f"case{i}"
        case.mkdir()
        root2, path = damaged_copy(stored, case, int(offset))
        store = open_store(root2, loaded)
        engine, cache = tiered_engine(loaded, store)
        cached, out = run(engine, turn2)
        assert out == expected, f"flip at byte {offset} changed the output"
        if cache.restores:  # only possible if the flip hit bytes nothing reads (none exist)
            pytest.fail(f"flip at byte {offset} was restored")
        store.close()

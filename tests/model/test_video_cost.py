"""`decode_cost` bounds what decoding and preparing a video's sampled frames takes: each video
decodes in a fresh process whose peak resident memory (VmHWM, reset through /proc/self/clear_refs
just before) is measured against the bill its header earns (as tests/model/test_decode_cost.py
does for images). The bill must hold and stay within a small factor of the truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASURE = """
import json, sys
import av  # (its libraries' pages are not the decode's)
from model.vision.video import *

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

data = open(sys.argv[1], "rb").read()
config = VideoProcessorConfig(max_pixels=int(sys.argv[2]))
header = read_video_header(data)
indices = sample_indices(header.frames, header.fps, config)
size = resized_size(len(indices), header.height, header.width, config)
cost = decode_cost(len(indices), header.height, header.width, config)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from here
before = status("VmRSS:")
prepared = prepare_video(decode_frames(data, indices, size), config)
print(json.dumps({"peak": status("VmHWM:") - before, "bill": cost.peak, "output": cost.output,
                  "nbytes": prepared.pixel_values.nbytes}))
"""

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc"),
    pytest.mark.slow,
]


def gradient(height: int, width: int, shift: int) -> np.ndarray:
    y = np.arange(height)[:, None] * 7 + np.arange(width)[None, :] * 3 + shift * 5
    return np.stack([y % 256, (y // 3) % 256, (y * 5) % 256], -1).astype(np.uint8)


@pytest.mark.parametrize(
    ("height", "width", "codec", "container", "max_pixels"),
    [
        (240, 320, "mpeg4", "mp4", 32 * 32 * 96),  # small: the decoder's own buffers dominate
        (720, 1280, "libx264", "mp4", 32 * 32 * 96),  # the source frames dominate
        (720, 1280, "libx264", "mp4", 25_165_824),  # Qwen3-VL's bound: the resized frames dominate
        (1080, 1920, "libvpx-vp9", "webm", 32 * 32 * 96),
    ],
)
def test_the_bill_bounds_the_measured_peak(tmp_path, height, width, codec, container, max_pixels):
    pytest.importorskip("av")
    from tests.helpers.media import encode_video

    path = tmp_path / f"video.{container}"
    path.write_bytes(encode_video([gradient(height, width, k) for k in range(30)], 10, codec, container))
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(max_pixels)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    measured = json.loads(out.stdout)
    assert measured["output"] == measured["nbytes"]
    assert measured["peak"] <= measured["bill"] <= 3 * measured["peak"], measured

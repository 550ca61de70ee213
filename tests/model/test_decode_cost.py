"""`decode_cost` bounds what `load_image` really takes: each image decodes in a fresh process whose
peak resident memory (VmHWM, reset through /proc/self/clear_refs just before) is measured against
the bill its header earns. The bill must hold (admission of image requests relies on it) and stay
within a small factor of the truth (else it refuses requests that fit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SMALL_MAX_PIXELS = 28 * 28 * 64  # the tiny test checkpoint's: the full-size decode dominates
QWEN_MAX_PIXELS = 12_845_056  # Qwen2.5-VL's: the resized stage dominates

MEASURE = """
import json, sys
from model.vision.header import read_header
from model.vision.preprocess import ImageProcessorConfig, decode_cost, load_image

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

data = open(sys.argv[1], "rb").read()
config = ImageProcessorConfig(max_pixels=int(sys.argv[2]))
cost = decode_cost(read_header(data, max_pixels=8192 * 8192, max_frames=1), config)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from here
before = status("VmRSS:")
prepared = load_image(data, config, 8192 * 8192)
print(json.dumps({"peak": status("VmHWM:") - before, "bill": cost.peak, "output": cost.output,
                  "nbytes": prepared.pixel_values.nbytes}))
"""

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")


def gradient(width: int, height: int) -> Image.Image:
    y = np.arange(height, dtype=np.uint32)[:, None] * 7 + np.arange(width, dtype=np.uint32)[None, :] * 3
    return Image.fromarray(np.stack([y % 256, (y // 3) % 256, (y * 5) % 256], -1).astype(np.uint8))


@pytest.mark.parametrize(
    ("fmt", "mode", "max_pixels"),
    [
        ("PNG", "RGB", SMALL_MAX_PIXELS),
        ("PNG", "RGBA", SMALL_MAX_PIXELS),
        ("PNG", "RGB", QWEN_MAX_PIXELS),
        ("JPEG", "RGB", SMALL_MAX_PIXELS),
        ("WEBP", "RGB", SMALL_MAX_PIXELS),
        ("GIF", "P", SMALL_MAX_PIXELS),
    ],
)
def test_the_bill_bounds_the_measured_peak(tmp_path, fmt, mode, max_pixels):
    path = tmp_path / f"image.{fmt.lower()}"
    gradient(3000, 2000).convert(mode).save(path, format=fmt)
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(max_pixels)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["nbytes"] == got["output"]
    assert 0 < got["peak"] <= got["bill"] <= 2.5 * got["peak"], got

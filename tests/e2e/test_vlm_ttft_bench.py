"""benchmarks/vlm_ttft.py end to end at its tiny shape (a small image: seconds on CPU): it writes a
loadable Qwen2.5-VL checkpoint, the server answers every request kind, usage counts the grid's
image tokens, and the repeat and the second turn hit the prompt cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_every_request_kind(tmp_path: Path) -> None:
    out = tmp_path / "vlm.json"
    cmd = [sys.executable, "benchmarks/vlm_ttft.py", "--shape", "tiny", "--image-size", "224", "--repeats", "1"]
    done = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["image_tokens"] == 64  # 224x224 -> a 16x16 patch grid, 8x8 after the merge
    server = result["server"]
    assert server["image_miss"][0]["prompt_tokens"] == server["text_plain"]["prompt_tokens"] + 64 + 2
    assert server["image_repeat"]["cached_tokens"] == server["image_repeat"]["prompt_tokens"] - 1
    assert server["second_turn"]["cached_tokens"] > server["image_miss"][0]["prompt_tokens"] - 5
    assert all(r["ttft_s"] > 0 for r in [*server["image_miss"], *server["text_only"]])
    assert "| image, cold (fresh image), median |" in result["table"]

"""model.load.blas: preloading an optimized BLAS for MLX's Linux CPU backend.

Each check runs in a fresh subprocess: the BLAS must be preloaded before mlx is imported,
and this pytest process has very likely imported mlx already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU backend only")

_SCRIPT = r"""
import json, sys
from model.load.blas import preload_optimized_blas, BlasInfo
info = preload_optimized_blas(*sys.argv[1:2])  # the setting, when the test passes one
assert isinstance(info, BlasInfo)
assert preload_optimized_blas("off") is info  # idempotent: the first result stands
import mlx.core as mx
import numpy as np
mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)
ok = True
for m, k, n in [(257, 300, 129), (1, 512, 1000), (33, 64, 65)]:
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    ok &= bool(np.allclose(np.array(mx.array(a) @ mx.array(b)), a @ b, rtol=1e-4, atol=1e-3))
    ok &= bool(np.allclose(np.array(mx.array(a) @ mx.array(b.T.copy()).T), a @ b, rtol=1e-4, atol=1e-3))
a64 = rng.standard_normal((40, 50))
x64 = mx.array(a64, dtype=mx.float64)  # exercises cblas_dgemm
ok &= bool(np.allclose(np.array(mx.matmul(x64, x64.T, stream=mx.cpu)), a64 @ a64.T))
late = __import__("model.load.blas", fromlist=["x"]).preload_optimized_blas(force=True)
print("JSON:" + json.dumps({"name": info.name, "path": info.path, "reason": info.reason,
      "optimized": info.optimized, "log": info.log_line(), "ok": ok, "late_reason": late.reason}))
"""


def _run(*setting: str, path: Path | None = None) -> dict:
    """Run the script with `preload_optimized_blas(*setting)`; `path`: a directory put first on
    the subprocess's import path."""
    paths = [str(p) for p in (path, ROOT) if p is not None]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *setting], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:"))
    return json.loads(line[5:])


def test_default_preload_gives_correct_matmul():
    r = _run()
    assert r["ok"], r
    assert r["name"] and r["log"].startswith("BLAS: ")
    if r["optimized"]:
        assert r["path"] and os.path.exists(r["path"])
    else:
        assert "bundled" in r["name"]
    # calling again after mlx is imported cannot preload anything and says so
    assert "imported before" in r["late_reason"]


@pytest.mark.parametrize("setting", ["off", "none", "bundled"])
def test_off_reports_bundled(setting):
    r = _run(setting)
    assert r["ok"], r
    assert not r["optimized"] and r["path"] is None
    assert "bundled" in r["name"] and f"blas setting {setting!r}" in r["reason"]
    assert "install" in r["log"]


def test_bad_explicit_path_falls_back_silently(tmp_path):
    bogus = tmp_path / "libnotblas.so"
    bogus.write_bytes(b"not an ELF file")
    r = _run(str(bogus))
    assert r["ok"], r
    assert not r["optimized"] and "unusable" in r["reason"]


def test_an_installed_cuda_build_skips_preload(tmp_path):
    dist = tmp_path / "mlx_cuda_13-0.0.0.dist-info"  # what pip leaves for mlx[cuda13]
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-cuda-13\nVersion: 0.0.0\n")
    r = _run(path=tmp_path)
    assert not r["optimized"] and r["path"] is None
    assert "mlx-cuda-13 installed" in r["reason"]


def test_explicit_path_is_used():
    from model.load import blas

    cands = blas._candidates()
    if not cands:
        pytest.skip("no optimized BLAS installed (apt-get install libopenblas0-pthread)")
    path = cands[0][0]
    r = _run(path)
    assert r["ok"], r
    assert r["optimized"] and r["path"] == path and r["reason"] == "requested path"


def test_blas_info_is_frozen():
    import attrs

    from model.load.blas import BUNDLED_NAME, BlasInfo

    info = BlasInfo(name=BUNDLED_NAME, path=None, reason="x")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        info.name = "y"  # type: ignore[misc]
    assert not info.optimized and "slow" in info.log_line()

"""The CUDA kernels a test module uses, each compiled and run once on a minimal problem in a child
process of its own, several at a time, under a time limit: a kernel that fails to compile,
computes garbage, faults or hangs is reported by name within a minute instead of stalling the
suite, and every test that would build it fails at once with that report (`guard`). Each kernel
(one source and set of constants) is one NVRTC compile of ~1.5-3 s, paid again in the test process;
a module declares the kernels it builds (its plan), and building one outside the plan fails the
test that does, so the count stays what the module says.

    python -m tests.helpers.cuda_smoke '["qmm", "bfloat16", 4, 1, 8, 1, 8, 2, false]'   (one child)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import pytest

from model import quant_kernel
from model.kv import paged_kernel
from model.kv import quant_kernel as kv_quant_kernel

ROOT = Path(__file__).resolve().parents[2]

# ("qmm", dtype name, bits, maxnt, wn, wk, s, u, gather), ("kvq", dtype name, bits, heads per KV
# head) or ("kvp", dtype name, head dim, heads per KV head)
Spec = tuple[Any, ...]
_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}


def _dtype_name(dtype: mx.Dtype) -> str:
    return "bfloat16" if dtype == mx.bfloat16 else "float16"


def qmm_spec(dtype: mx.Dtype, bits: int, maxnt: int, cfg: quant_kernel.Config, gather: bool) -> Spec:
    return ("qmm", _dtype_name(dtype), bits, maxnt, cfg.wn, cfg.wk, cfg.s, cfg.u, gather)


def kvq_spec(dtype: mx.Dtype, bits: int, group: int) -> Spec:
    return ("kvq", _dtype_name(dtype), bits, group)


def kvp_spec(dtype: mx.Dtype, head_dim: int, group: int) -> Spec:
    return ("kvp", _dtype_name(dtype), head_dim, group)


def name(spec: Spec) -> str:
    if spec[0] == "qmm":
        _, dt, bits, maxnt, wn, wk, s, u, gather = spec
        return quant_kernel._kernel_name(_DTYPES[dt], bits, maxnt, quant_kernel.Config(wn, wk, s, u), gather)
    if spec[0] == "kvp":
        _, dt, head_dim, group = spec
        return paged_kernel._name("attend", _DTYPES[dt], head_dim, group)
    _, dt, bits, group = spec
    return kv_quant_kernel._name("attend", _DTYPES[dt], bits, group)


@attrs.frozen
class Outcome:
    ok: bool
    seconds: float  # the child's compile and first run (or how long it was given)
    message: str = ""


def _rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err: float = (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()  # type: ignore[assignment]
    return err


def _qmm_problem(dtype: mx.Dtype, bits: int, maxnt: int, cfg: quant_kernel.Config, gather: bool) -> float:
    """One block tile of output columns, one block iteration of K, the bucket's full rows."""
    n, k, rows = 16 * cfg.wn, cfg.k_step(bits), 8 * maxnt
    gs = 64 if k % 64 == 0 else 32
    experts = 2 if gather else 0
    shape = (experts, n, k) if gather else (n, k)
    w = (mx.random.normal(shape, key=mx.random.key(1)) * 0.05).astype(dtype)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.random.normal((rows, k), key=mx.random.key(2)).astype(dtype)
    deq = mx.dequantize(q, s, b, group_size=gs, bits=bits).astype(mx.float32)
    if gather:
        idx = mx.array([0] * (rows // 2) + [1] * (rows - rows // 2), mx.uint32)
        rowmap = mx.arange(rows, dtype=mx.uint32)
        want = (x.astype(mx.float32)[:, None, :] * deq[idx]).sum(-1)
        mx.eval(q, s, b, x, want, idx, rowmap)
        start = time.perf_counter()
        got = quant_kernel.gather_qmm(x, q, s, b, rowmap, idx, bits, cfg=cfg, rows_per_expert=rows)
    else:
        want = x.astype(mx.float32) @ deq.T
        mx.eval(q, s, b, x, want)
        start = time.perf_counter()
        got = quant_kernel.qmm(x, q, s, b, bits, cfg)
    mx.eval(got)
    seconds = time.perf_counter() - start
    err = _rel_err(got, want)
    if not err < 2e-2:
        raise AssertionError(f"differs from the dequantized product by {err:.3g}")
    return seconds


def _kvq_problem(dtype: mx.Dtype, bits: int, group: int) -> float:
    """One row, one KV head of 40 positions (one chunk): the attend and the combine kernel."""
    q = mx.random.normal((1, group, 1, 128), key=mx.random.key(1)).astype(dtype)
    cache = [mx.random.normal((1, 1, 40, 128), key=mx.random.key(i)).astype(dtype) for i in (2, 3)]
    k, v = (mx.quantize(c, group_size=64, bits=bits) for c in cache)
    kd, vd = (mx.dequantize(*t, group_size=64, bits=bits) for t in (k, v))
    want = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=128**-0.5)
    mx.eval(q, *k, *v, want)
    start = time.perf_counter()
    got = kv_quant_kernel.decode_attention(q, k, v, 128**-0.5, None, bits)
    mx.eval(got)
    seconds = time.perf_counter() - start
    err = _rel_err(got, want)
    if not err < 3e-2:
        raise AssertionError(f"differs from attention over the dequantized cache by {err:.3g}")
    return seconds


def _kvp_problem(dtype: mx.Dtype, head_dim: int, group: int) -> float:
    """One row, one KV head of 40 positions in the pool's second block: the attend and the combine."""
    q = mx.random.normal((1, group, 1, head_dim), key=mx.random.key(1)).astype(dtype)
    kp, vp = (mx.random.normal((2, 1, 256, head_dim), key=mx.random.key(i)).astype(dtype) for i in (2, 3))
    want = paged_kernel.gathered_attention(q, kp, vp, [[1]], [40], head_dim**-0.5)
    table, lengths = mx.array([[1]], mx.int32), mx.array([40], mx.int32)
    mx.eval(q, kp, vp, want, table, lengths)
    start = time.perf_counter()
    got = paged_kernel.decode_attention(q, kp, vp, table, lengths, head_dim**-0.5)
    mx.eval(got)
    seconds = time.perf_counter() - start
    err = _rel_err(got, want)
    if not err < 3e-2:
        raise AssertionError(f"differs from attention over the gathered rows by {err:.3g}")
    return seconds


def run_one(spec: Spec) -> float:
    """The child's side: build and run the kernel of `spec`; seconds of its first call."""
    if spec[0] == "qmm":
        _, dt, bits, maxnt, wn, wk, s, u, gather = spec
        return _qmm_problem(_DTYPES[dt], bits, maxnt, quant_kernel.Config(wn, wk, s, u), gather)
    if spec[0] == "kvp":
        _, dt, head_dim, group = spec
        return _kvp_problem(_DTYPES[dt], head_dim, group)
    _, dt, bits, group = spec
    return _kvq_problem(_DTYPES[dt], bits, group)


def run(specs: Iterable[Spec], *, timeout: float = 60.0, jobs: int | None = None) -> dict[Spec, Outcome]:
    """Every spec's kernel in its own child process, `jobs` at a time, each given `timeout` seconds."""
    pending = sorted(set(specs), key=str)
    jobs = jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
    running: dict[Spec, tuple[subprocess.Popen[bytes], Any, float]] = {}
    out: dict[Spec, Outcome] = {}
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            log = tempfile.TemporaryFile()
            cmd = [sys.executable, "-m", "tests.helpers.cuda_smoke", json.dumps(spec)]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            running[spec] = (proc, log, time.monotonic())
        for spec, (proc, log, started) in list(running.items()):
            waited = time.monotonic() - started
            if proc.poll() is None and waited < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                out[spec] = Outcome(False, waited, f"no result in {timeout:.0f} s: its compile or the kernel hangs")
            else:
                log.seek(0)
                text = log.read().decode(errors="replace").strip()
                last = text.splitlines()[-1] if text else ""
                if proc.returncode == 0 and last.startswith("{"):
                    out[spec] = Outcome(True, float(json.loads(last)["seconds"]))
                else:
                    out[spec] = Outcome(False, waited, f"exit {proc.returncode}: {text[-1500:]}")
            log.close()
            del running[spec]
        time.sleep(0.05)
    return out


def report(config: pytest.Config, where: str, outcomes: dict[Spec, Outcome], wall: float) -> None:
    """One line for the module's kernels (more for each failure), on the terminal as they come."""
    writer = config.pluginmanager.get_plugin("terminalreporter")
    ok = [o.seconds for o in outcomes.values() if o.ok]
    lines = [
        f"cuda kernels ({where}): {len(outcomes)} planned, each compiled and run in a child in {wall:.1f} s "
        f"(first call {min(ok, default=0):.2f}-{max(ok, default=0):.2f} s); "
        f"{len(outcomes) - len(ok)} failed"
    ]
    lines += [f"cuda kernels: {name(s)} FAILED: {o.message}" for s, o in sorted(outcomes.items()) if not o.ok]
    for line in lines:
        if writer is not None:
            writer.write_line(line)
        else:
            print(line, file=sys.stderr)


def guard(
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    spec_of: Callable[..., Spec | None],
    outcomes: dict[Spec, Outcome],
) -> None:
    """Route `module._kernel` through the smoke results: a kernel that failed its smoke run fails
    the test at once (never runs here); one outside the plan fails it too. `spec_of(*key)`: the
    spec of a `_kernel` call's arguments (None: allowed when any planned kernel passed)."""
    real = module._kernel

    def guarded(*key: Any) -> Any:
        spec = spec_of(*key)
        if spec is None:
            if not any(o.ok for o in outcomes.values()):
                pytest.fail("no planned kernel ran: see the smoke lines")
            return real(*key)
        outcome = outcomes.get(spec)
        if outcome is None:
            pytest.fail(f"kernel {name(spec)} is not in this module's plan: add it there (each is an NVRTC compile)")
        if not outcome.ok:
            pytest.fail(f"kernel {name(spec)} failed its smoke run: {outcome.message}")
        return real(*key)

    monkeypatch.setattr(module, "_kernel", guarded)


def main(argv: list[str]) -> int:
    spec = tuple(json.loads(argv[0]))
    print(json.dumps({"seconds": run_one(spec)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

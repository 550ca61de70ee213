"""model/kernels/cuda_build.py: our CUDA kernels built once per machine. On the CPU: what a launch
hands `mx.fast.precompiled_cuda_kernel` (the shapes the body reads, as scalars after the
outputs, in the order the generated signature declares them), the fallback to
`mx.fast.cuda_kernel` when a build fails, and the disk cache (a hit compiles nothing, a corrupt
file is a miss). Where an NVRTC library and the CUDA headers are at hand (the GPU machine; any
machine with the `nvidia-cuda-nvrtc` wheel and a CUDA toolkit's headers), every kernel's real
call sites are compiled to cubins (`slow`). Running the cubins: the CUDA-only kernel tests."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from model import quant_kernel
from model.kernels import cuda_build
from model.kv import paged_kernel
from model.kv import quant_kernel as kv_quant_kernel
from model.lora import kernel as lora_kernel


class FakeNvrtc:
    version = "13.0"

    def __init__(self) -> None:
        self.compiled: list[str] = []

    def compile(self, source: str, name: str, options: Any) -> bytes:
        self.compiled.append(name)
        return f"cubin of {name} from {len(source)} characters".encode()


@pytest.fixture
def launches(monkeypatch, tmp_path):
    """A builder over a fake compiler and a precompiled launch that records its arguments (and
    answers zeros of the requested outputs)."""
    nvrtc = FakeNvrtc()
    b = cuda_build.Builder(tmp_path, "sm_90a", nvrtc, [])  # type: ignore[arg-type]
    monkeypatch.setattr(cuda_build, "builder", lambda: b)
    calls: list[dict[str, Any]] = []

    def launch(**kw: Any) -> list[mx.array]:
        calls.append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    return calls, nvrtc


def test_a_launch_passes_inputs_outputs_then_the_shapes_the_body_reads(launches):
    calls, nvrtc = launches
    body = "y[0] = w_shape[1] + x_shape[0] + K;"
    k = cuda_build.kernel("probe", ["x", "w", "s"], ["y"], body, header="// h", shared_memory=60000)
    x, w, s = mx.zeros((3, 5)), mx.zeros((7, 2, 4), mx.uint32), mx.zeros((2,))
    (y,) = k(
        inputs=[x, w, s],
        output_shapes=[(3, 7)],
        output_dtypes=[mx.bfloat16],
        grid=(96, 1, 1),
        threadgroup=(32, 1, 1),
        template=[("K", 4), ("TY", mx.bfloat16)],
    )
    assert y.shape == (3, 7) and y.dtype == mx.bfloat16
    (call,) = calls
    pad = [0] * (cuda_build.MAX_NDIM - 2)
    assert call["scalars"] == [3, 5, *pad, 7, 2, 4, *pad[1:]]  # x's then w's; s's shape is not read
    assert call["name"] == "custom_kernel_probe_4_bfloat16" == nvrtc.compiled[0]
    assert call["compiled_source"].startswith(b"cubin of custom_kernel_probe_4_bfloat16 from")
    assert call["shared_memory"] == 60000 and call["ensure_row_contiguous"] is True
    assert call["grid"] == (96, 1, 1) and call["threadgroup"] == (32, 1, 1)
    source = cuda_build.kernel_source(
        call["name"], "// h", body, ["x", "w", "s"], [mx.float32, mx.uint32, mx.float32], ["y"], [mx.bfloat16],
        [("K", 4), ("TY", mx.bfloat16)],
    )  # fmt: skip
    params = re.search(r'extern "C" __global__ void \w+\(([^)]*)\)', source)
    assert params is not None
    names = [p.split()[-1] for p in params.group(1).split(",")]
    shape_params = [f"{n}_shape_{i}" for n in ("x", "w") for i in range(cuda_build.MAX_NDIM)]
    assert names == ["x", "w", "s", "y", *shape_params]
    assert "const float* x" in source and "const uint32_t* w" in source and "__nv_bfloat16* y" in source
    assert "constexpr int K = 4;" in source and "using TY = __nv_bfloat16;" in source
    k(inputs=[x, w, s], output_shapes=[(3, 7)], output_dtypes=[mx.bfloat16], grid=(96, 1, 1), threadgroup=(32, 1, 1),
      template=[("K", 4), ("TY", mx.bfloat16)])  # fmt: skip
    assert len(nvrtc.compiled) == 1 and len(calls) == 2  # one build per variant


def test_a_failed_build_runs_mlx_s_own_kernel_with_the_same_arguments(monkeypatch):
    def no_builder() -> cuda_build.Builder:
        raise cuda_build.BuildError("no NVRTC library")

    made: list[dict[str, Any]] = []
    ran: list[dict[str, Any]] = []

    def cuda_kernel(**kw: Any) -> Any:
        made.append(kw)
        return lambda **call: ran.append(call) or [mx.zeros((1,))]

    monkeypatch.setattr(cuda_build, "builder", no_builder)
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    k = cuda_build.kernel("probe", ["x"], ["y"], "y[0] = x[0];", ensure_row_contiguous=False, shared_memory=128)
    for _ in range(2):
        k(
            inputs=[mx.zeros((2,))],
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
        )
    assert made == [
        {
            "name": "probe",
            "input_names": ["x"],
            "output_names": ["y"],
            "source": "y[0] = x[0];",
            "header": "",
            "ensure_row_contiguous": False,
            "shared_memory": 128,
        }
    ]
    assert len(ran) == 2 and ran[0]["grid"] == (1, 1, 1) and ran[0]["template"] == []


def test_the_disk_cache_serves_other_processes_and_a_corrupt_file_is_a_miss(tmp_path):
    first, second = FakeNvrtc(), FakeNvrtc()
    a = cuda_build.Builder(tmp_path, "sm_90a", first, [])  # type: ignore[arg-type]
    b = cuda_build.Builder(tmp_path, "sm_90a", second, [])  # type: ignore[arg-type]  # another process
    code = a.cubin("source one", "k1")
    (path,) = tmp_path.iterdir()
    assert b.cubin("source one", "k1") == code and second.compiled == []
    assert (a.built, a.hits, b.built, b.hits) == (1, 0, 0, 1)
    assert b.summary().startswith("1 from the disk cache, 0 built (0.0 s)")
    assert b.cubin("source number two", "k1") != code and second.compiled == ["k1"]  # another file
    path.write_bytes(path.read_bytes()[:-1] + b"X")
    assert b.cubin("source one", "k1") == code and second.compiled == ["k1", "k1"]  # rebuilt
    c = cuda_build.Builder(tmp_path, "sm_80", FakeNvrtc(), [])  # type: ignore[arg-type]
    c.cubin("source one", "k1")
    assert c.nvrtc.compiled == ["k1"]  # type: ignore[attr-defined]  # another architecture: its own build


def test_a_cache_that_cannot_be_written_still_builds(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    b = cuda_build.Builder(blocker / "cache", "sm_90a", FakeNvrtc(), [])  # type: ignore[arg-type]
    assert b.cubin("src", "k") == b"cubin of k from 3 characters"


def _emulated_probe(**kw: Any) -> list[mx.array]:
    """The probe kernel's body, run on its launch arguments: y = x + 100 * shape[0] + shape[1] + 7
    (another kernel: zeros)."""
    if "probe" not in kw["name"]:
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)]
    (x,) = kw["inputs"]
    return [x + 100 * kw["scalars"][0] + kw["scalars"][1] + 7]


@pytest.mark.parametrize("answer", ["right", "wrong", "raises"])
def test_the_probe_decides_whether_any_kernel_is_built_here(monkeypatch, tmp_path, answer):
    """The first kernel of a process first runs the probe through the whole road; a wrong answer
    or a failed launch leaves every kernel to MLX's own build."""
    launches = {
        "right": _emulated_probe,
        "wrong": lambda **kw: [mx.zeros((4, 3))],
        "raises": lambda **kw: (_ for _ in ()).throw(RuntimeError("cuModuleLoadDataEx failed")),
    }
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launches[answer])
    monkeypatch.setattr(cuda_build, "architecture", lambda: "sm_90a")
    monkeypatch.setattr(cuda_build, "Nvrtc", FakeNvrtc)
    monkeypatch.setattr(cuda_build, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(cuda_build, "_builder", None)
    monkeypatch.setattr(cuda_build, "_builder_error", None)
    assert cuda_build.prepare() is False and cuda_build._builder_error is None  # no CUDA here: nothing tried
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert cuda_build.prepare() is (answer == "right")  # at a model's load: the probe runs there
    ran_by_mlx: list[str] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **made: lambda **kw: ran_by_mlx.append(made["name"]) or [])
    k = cuda_build.kernel("after", ["x"], ["y"], "y[0] = x[0];")
    k(inputs=[mx.zeros((2,))], output_shapes=[(2,)], output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1))
    if answer == "right":
        assert isinstance(cuda_build.builder(), cuda_build.Builder) and ran_by_mlx == []
        assert (cuda_build.summary() or "").startswith("our CUDA kernels: 0 from the disk cache, 2 built")
    else:
        assert cuda_build.summary() is None
        with pytest.raises(cuda_build.BuildError):
            cuda_build.builder()
        assert ran_by_mlx == ["after"]


def _nvrtc() -> cuda_build.Nvrtc | None:
    """The NVRTC library: loaded already (MLX's CUDA build), else a `nvidia-cuda-nvrtc` wheel's."""
    try:
        return cuda_build.Nvrtc()
    except cuda_build.BuildError:
        pass
    for root in sys.path:
        lib = Path(root) / "nvidia" / "cu13" / "lib"
        if (lib / "libnvrtc.so.13").is_file():
            for builtins in lib.glob("libnvrtc-builtins.so.*"):  # NVRTC opens it by name
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return cuda_build.Nvrtc(str(lib / "libnvrtc.so.13"))
    return None


@pytest.mark.slow
def test_every_kernel_s_call_sites_compile_with_nvrtc(monkeypatch, tmp_path):
    """Each kernel module's real calls (their dtypes, templates, headers) through NVRTC to an
    sm_90a cubin: the generated signature and prelude are enough for every body. The one body
    that reads a view's strides (quantized-KV attention) keeps MLX's build."""
    nvrtc = _nvrtc()
    includes = cuda_build.include_dirs()
    if nvrtc is None or not any((d / "cuda_bf16.h").is_file() for d in includes):
        pytest.skip("no NVRTC library or CUDA headers here")
    b = cuda_build.Builder(tmp_path, "sm_90a", nvrtc, includes)
    monkeypatch.setattr(cuda_build, "builder", lambda: b)
    built: list[str] = []
    by_mlx: list[str] = []

    def launch(**kw: Any) -> list[mx.array]:
        built.append(kw["name"])
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)]

    def cuda_kernel(**made: Any) -> Any:
        by_mlx.append(made["name"])
        return lambda **kw: [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"], strict=True)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    for module in (quant_kernel, kv_quant_kernel, paged_kernel, lora_kernel):
        monkeypatch.setattr(module, "_kernels", {})
    _call_every_kernel()
    assert by_mlx == ["kvq_attend_bf16_b4_r2_c256"]
    assert len(built) == 7 and len(list(tmp_path.iterdir())) == 7, built
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", _emulated_probe)
    cuda_build.probe(b)  # the probe's source too
    assert len(list(tmp_path.iterdir())) == 8 and all(len(p.read_bytes()) > 1000 for p in tmp_path.iterdir())


def _call_every_kernel() -> None:
    bf16 = mx.bfloat16
    w, s, bias = mx.quantize(mx.random.normal((256, 512)).astype(bf16), group_size=64, bits=4)
    quant_kernel.qmm(mx.zeros((3, 512), bf16), w, s, bias, 4)
    we, se, be = mx.quantize(mx.random.normal((2, 256, 512)).astype(mx.float16), group_size=64, bits=8)
    rowmap, experts = mx.array([0, 1], mx.uint32), mx.array([0, 1], mx.uint32)
    quant_kernel.gather_qmm(mx.zeros((2, 512), mx.float16), we, se, be, rowmap, experts, 8)
    kv = mx.quantize(mx.random.normal((1, 2, 256, 128)).astype(bf16), group_size=64, bits=4)
    kv_quant_kernel.decode_attention(mx.zeros((1, 4, 1, 128), bf16), kv, kv, 0.1, None, 4)
    pool = mx.zeros((3, 2, paged_kernel.BLOCK, 64), bf16)
    table, lengths = mx.array([[0, 2]], mx.int32), mx.array([300], mx.int32)
    paged_kernel.decode_attention(mx.zeros((1, 4, 1, 64), bf16), pool, pool, table, lengths, 0.125)
    x, at, bmat = mx.zeros((2, 64), bf16), mx.zeros((8, 64), bf16), mx.zeros((8, 64), bf16)
    mask, scale = mx.ones((1, 8), bf16), mx.ones((8,), mx.float32)
    lora_kernel.add_delta(mx.zeros((2, 64), bf16), x, at, bmat, mask, scale)

"""Our CUDA kernels built once per machine, not once per process.

`mx.fast.cuda_kernel` compiles its source with NVRTC the first time each process calls it, and
keeps nothing on disk: every server start paid ~3 s per kernel (MLX's device headers make up
most of that), several per model. `kernel(...)` takes the same arguments and gives a callable
with the same call, which instead:

* writes the whole kernel itself (`kernel_source`): a C-linkage function whose parameters are
  the inputs, the outputs, then every `<input>_shape` the body reads as `MAX_NDIM` int scalars
  (the body still indexes `<input>_shape[i]`) and every `<input>_ndim`, the template arguments
  as constants, and only the CUDA headers the bodies use;
* compiles it with the NVRTC library MLX itself loads (through ctypes) to a cubin for this GPU's
  compute capability, kept under `<cache>/cuda-kernels/` (`$MLX_TRIO_CACHE`, else
  `~/.cache/mlx-trio`), named by a hash of everything that went into it (source, options, the
  GPU's architecture, NVRTC's and MLX's versions), with a checksum: a file that does not match
  is a miss and is rebuilt;
* launches it with `mx.fast.precompiled_cuda_kernel`, once a probe kernel has made the same
  road and answered right (`probe`, at the process's first kernel).

A body that reads `<input>_strides` keeps MLX's build: a view's strides are known only when the
graph runs, and a launch's scalars are fixed when it is built. Anything that fails on the road
(no NVRTC, a compile error, an input with more dimensions than `MAX_NDIM`) falls back to
`mx.fast.cuda_kernel` with the original arguments, for that variant, logged once: never a wrong
kernel, at worst the old start-up cost.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from model.load.demo import cache_root

log = logging.getLogger(__name__)

MAX_NDIM = 8  # shape entries passed per `<input>_shape` the body reads
_CHECKSUM = 32  # bytes of sha256 ahead of the cubin in a cache file

_CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.uint8: "uint8_t",
    mx.int16: "int16_t",
    mx.uint16: "uint16_t",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}

_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/cstdint>
#include <cuda/std/cmath>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
using cuda::std::int8_t; using cuda::std::uint8_t; using cuda::std::int16_t; using cuda::std::uint16_t;
using cuda::std::int32_t; using cuda::std::uint32_t; using cuda::std::int64_t; using cuda::std::uint64_t;
"""

Template = Sequence[tuple[str, Any]]


def cuda_type(dtype: mx.Dtype) -> str:
    if dtype not in _CUDA_TYPES:
        raise ValueError(f"no CUDA type for {dtype}")
    return _CUDA_TYPES[dtype]


def shapes_read(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """Which inputs' shape, strides and ndim the body reads (`<name>_shape`, `_strides`, `_ndim`),
    as MLX decides it."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def function_name(name: str, template: Template) -> str:
    """The kernel's function name: MLX's (`custom_kernel_<name>` plus the template values), so a
    header that refers to the function by name (a cluster shape on it) reads the same."""
    suffix = ""
    for _, value in template:
        if isinstance(value, bool):
            suffix += "_t" if value else "_f"
        elif isinstance(value, int):
            suffix += f"_{value}"
        else:
            suffix += "_" + _type_tag(value)
    return f"custom_kernel_{name}{suffix}"


def _type_tag(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def kernel_source(
    fname: str,
    header: str,
    source: str,
    input_names: Sequence[str],
    input_dtypes: Sequence[mx.Dtype],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Template,
) -> str:
    """The complete CUDA source of one variant (see the module docstring)."""
    reads = shapes_read(source, input_names)
    params = [f"const {cuda_type(d)}* {n}" for n, d in zip(input_names, input_dtypes, strict=True)]
    params += [f"{cuda_type(d)}* {n}" for n, d in zip(output_names, output_dtypes, strict=True)]
    shapes = ""
    for name, (shape, strides, ndim) in zip(input_names, reads, strict=True):
        if shape:
            params += [f"int {name}_shape_{i}" for i in range(MAX_NDIM)]
            values = ", ".join(f"{name}_shape_{i}" for i in range(MAX_NDIM))
            shapes += f"  const int {name}_shape[{MAX_NDIM}] = {{{values}}};\n"
        if strides:  # known only when the graph runs (a view's), never when it is built
            raise ValueError(f"the body reads {name}_strides")
        if ndim:
            params.append(f"int {name}_ndim")
    consts = ""
    for key, value in template:
        if isinstance(value, bool):
            consts += f"  constexpr bool {key} = {'true' if value else 'false'};\n"
        elif isinstance(value, int):
            consts += f"  constexpr int {key} = {value};\n"
        else:
            consts += f"  using {key} = {cuda_type(value)};\n"
    signature = ",\n    ".join(params)
    head = f'{_PRELUDE}{header}\nextern "C" __global__ void {fname}(\n    {signature}) {{\n'
    return f"{head}{shapes}{consts}{source}\n}}\n"


def shape_scalars(inputs: Sequence[mx.array], reads: Sequence[tuple[bool, bool, bool]]) -> list[int]:
    """The shape and ndim scalars of one launch, in parameter order (`kernel_source`), shapes
    padded to MAX_NDIM."""
    out: list[int] = []
    for x, (shape, _, ndim) in zip(inputs, reads, strict=True):
        if shape:
            if x.ndim > MAX_NDIM:
                raise ValueError(f"an input of {x.ndim} dimensions: more than {MAX_NDIM}")
            out += list(x.shape) + [0] * (MAX_NDIM - x.ndim)
        if ndim:
            out.append(x.ndim)
    return out


class BuildError(RuntimeError):
    """A kernel that could not be built here (then `mx.fast.cuda_kernel` runs it)."""


class Nvrtc:
    """The NVRTC library through ctypes: source -> cubin for one architecture."""

    def __init__(self, library: str | None = None):
        try:  # MLX's CUDA build links libnvrtc: once mlx.core is loaded, the soname finds it
            self.lib = ctypes.CDLL(library or "libnvrtc.so.13")
        except OSError as e:
            raise BuildError(f"no NVRTC library: {e}") from e
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise BuildError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: str, name: str, options: Sequence[str]) -> bytes:
        prog = ctypes.c_void_p()
        self._check(
            self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
            "nvrtcCreateProgram",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            if status != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, text)
                raise BuildError(f"{name} did not compile: {text.value.decode(errors='replace')[-2000:]}")
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def include_dirs() -> list[Path]:
    """Where the CUDA and CCCL headers are, as MLX's own JIT looks for them: MLX's bundled headers,
    then the CUDA runtime's Python package, else $CUDA_HOME / $CUDA_PATH / /usr/local/cuda."""
    mlx_dir = Path(mx.__file__).resolve().parent if getattr(mx, "__file__", None) else None
    dirs: list[Path] = []
    if mlx_dir is not None:
        bundled = mlx_dir / "include"
        dirs += [d for d in (bundled, bundled / "cccl") if d.is_dir()]
        runtime = mlx_dir.parent / "nvidia" / "cu13" / "include"
        if runtime.is_dir():  # (CCCL's own wheel puts its headers beside the runtime's)
            return [*dirs, runtime, *([runtime / "cccl"] if (runtime / "cccl").is_dir() else [])]
    home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    return [*dirs, home, *([home / "cccl"] if (home / "cccl").is_dir() else [])]


def architecture() -> str:
    """This GPU's NVRTC target, MLX's choice: sm_XY, with the `a` features from compute 9.0 on."""
    info = mx.device_info()
    major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


class Builder:
    """Compiles sources to cubins, through a disk cache shared by every process of the machine."""

    def __init__(self, directory: Path, arch: str, nvrtc: Nvrtc, includes: Sequence[Path]):
        self.directory, self.arch, self.nvrtc = directory, arch, nvrtc
        self.options = [
            f"--gpu-architecture={arch}",
            "--device-as-default-execution-space",
            *(f"--include-path={d}" for d in includes),
        ]
        self._lock = threading.Lock()
        self.hits = self.built = 0  # cubins read from the cache / compiled, this process
        self.build_s = 0.0

    def cubin(self, source: str, name: str) -> bytes:
        key = hashlib.sha256(
            "\0".join([source, *self.options, self.nvrtc.version, getattr(mx, "__version__", "")]).encode()
        ).hexdigest()
        path = self.directory / f"{name[:80]}-{key[:24]}.cubin"
        cached = _read(path)
        if cached is not None:
            self.hits += 1
            return cached
        with self._lock:
            started = time.perf_counter()
            code = self.nvrtc.compile(source, name, self.options)
            self.built += 1
            self.build_s += time.perf_counter() - started
        _write(path, code)
        return code

    def summary(self) -> str:
        """What this process's kernels cost to build: "3 from the disk cache, 2 built (1.6 s)"."""
        return f"{self.hits} from the disk cache, {self.built} built ({self.build_s:.1f} s) in {self.directory}"


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    code = data[_CHECKSUM:]
    return code if code and hashlib.sha256(code).digest() == data[:_CHECKSUM] else None


def _write(path: Path, code: bytes) -> None:
    """Atomically (a rename), so a reader never sees half a file; a failure only costs the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # (our code, run on the GPU: ours alone)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(code).digest() + code)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("CUDA kernel cache: could not write %s: %s", path, e)


_builder: Builder | None = None
_builder_error: str | None = None

# The probe: a kernel through the whole road (source, cubin, precompiled launch with shape
# scalars), run once per process before any kernel of ours takes it.
_PROBE_BODY = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[0] * x_shape[1]) y[i] = x[i] + 100.0f * x_shape[0] + x_shape[1] + OFFSET;
"""


def probe(b: Builder) -> None:
    """Build and run the probe (eagerly: it evaluates); BuildError unless its answer is right."""
    x = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    fname = function_name("cuda_build_probe", [("OFFSET", 7)])
    source = kernel_source(fname, "", _PROBE_BODY, ["x"], [mx.float32], ["y"], [mx.float32], [("OFFSET", 7)])
    (y,) = mx.fast.precompiled_cuda_kernel(
        name=fname,
        compiled_source=b.cubin(source, fname),
        inputs=[x],
        output_shapes=[(4, 3)],
        output_dtypes=[mx.float32],
        scalars=shape_scalars([x], shapes_read(_PROBE_BODY, ["x"])),
        grid=(12, 1, 1),
        threadgroup=(32, 1, 1),
    )
    if not mx.array_equal(y, x + 410.0).item():  # 100 * 4 + 3 + 7
        raise BuildError(f"the probe kernel answered {y.tolist()}")


def builder() -> Builder:
    """The process's builder, made (and probed) on first use; BuildError (remembered) where there
    is none. A probe that cannot run (no CUDA, a failed launch, or a first use inside a traced
    function, where nothing can be evaluated) leaves every kernel to MLX's build."""
    global _builder, _builder_error
    if _builder is None and _builder_error is None:
        try:
            made = Builder(cache_root() / "cuda-kernels", architecture(), Nvrtc(), include_dirs())
            probe(made)
            _builder = made
        except Exception as e:  # noqa: BLE001 - any doubt: MLX builds the kernels, as before
            _builder_error = f"{type(e).__name__}: {e}"
            log.info("CUDA kernels: built by MLX at each start (%s)", _builder_error[:300])
    if _builder is None:
        raise BuildError(_builder_error or "no builder")
    return _builder


def summary() -> str | None:
    """The start-up line's account of our kernels' builds so far (None where nothing is built)."""
    return None if _builder is None else f"our CUDA kernels: {_builder.summary()}"


def prepare() -> bool:
    """On a CUDA GPU, make and probe the builder now, where evaluation is allowed (a model's load),
    rather than at a first kernel that may sit in a traced function; whether kernels will be
    built here. Never raises."""
    if not (mx.cuda.is_available() and mx.default_device().type == mx.gpu):
        return False
    try:
        builder()
    except BuildError:
        return False
    return True


class Kernel:
    """The callable `kernel` returns: `mx.fast.cuda_kernel`'s call, each variant (input and
    output dtypes, template) built once through the cache, or through MLX where that fails."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str,
        ensure_row_contiguous: bool,
        shared_memory: int,
    ):
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.ensure_row_contiguous, self.shared_memory = ensure_row_contiguous, shared_memory
        self.reads = shapes_read(source, input_names)
        self._built: dict[tuple[Any, ...], tuple[str, bytes] | None] = {}
        self._jit: Any = None

    def _variant(
        self, inputs: Sequence[mx.array], output_dtypes: Sequence[mx.Dtype], template: Template
    ) -> tuple[str, bytes] | None:
        key = (tuple(x.dtype for x in inputs), tuple(output_dtypes), tuple(template))
        if key not in self._built:
            fname = function_name(self.name, template)
            try:
                source = kernel_source(
                    fname,
                    self.header,
                    self.source,
                    self.input_names,
                    [x.dtype for x in inputs],
                    self.output_names,
                    output_dtypes,
                    template,
                )
                self._built[key] = (fname, builder().cubin(source, fname))
            except (BuildError, ValueError) as e:
                # (no builder at all was logged once, by `builder`)
                level = logging.DEBUG if _builder_error is not None else logging.INFO
                log.log(level, "CUDA kernel %s: built by MLX at each start (%s)", fname, str(e)[:300])
                self._built[key] = None
        return self._built[key]

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Template = (),
        init_value: float | None = None,
        stream: Any = None,
    ) -> list[mx.array]:
        built = self._variant(inputs, output_dtypes, template)
        scalars: list[int] | None = None
        if built is not None:
            try:
                scalars = shape_scalars(inputs, self.reads)
            except ValueError:
                scalars = None
        if built is None or scalars is None:
            return self._mlx_kernel()(
                inputs=inputs,
                output_shapes=output_shapes,
                output_dtypes=output_dtypes,
                grid=grid,
                threadgroup=threadgroup,
                template=list(template),
                init_value=init_value,
                stream=stream,
            )
        fname, code = built
        return mx.fast.precompiled_cuda_kernel(
            name=fname,
            compiled_source=code,
            inputs=list(inputs),
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
            scalars=scalars,
            grid=grid,
            threadgroup=threadgroup,
            shared_memory=self.shared_memory,
            init_value=init_value,
            ensure_row_contiguous=self.ensure_row_contiguous,
            stream=stream,
        )

    def _mlx_kernel(self) -> Any:
        if self._jit is None:
            self._jit = mx.fast.cuda_kernel(
                name=self.name,
                input_names=self.input_names,
                output_names=self.output_names,
                source=self.source,
                header=self.header,
                ensure_row_contiguous=self.ensure_row_contiguous,
                shared_memory=self.shared_memory,
            )
        return self._jit


def kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    shared_memory: int = 0,
) -> Kernel:
    """`mx.fast.cuda_kernel`'s arguments; the kernel is built once per machine (module docstring)."""
    return Kernel(name, input_names, output_names, source, header, ensure_row_contiguous, shared_memory)

"""Give MLX's Linux CPU backend an optimized BLAS instead of the bundled reference one.

    !!! preload_optimized_blas() MUST run before the first `import mlx` anywhere in the  !!!
    !!! process (including indirect imports: model.load.loader, model.nn.decoder, mlx_lm, ...).  !!!
    !!! Once libmlx.so is loaded its cblas_* references are bound and this is a no-op.   !!!

Why this works: the `mlx[cpu]` wheel (mlx-cpu 0.32.4) ships libmlx.so with `cblas_sgemm`,
`cblas_dgemm`, `cblas_cgemm` and ~20 LAPACK `*_` symbols *undefined*; its DT_NEEDED entries
point at a bundled, auditwheel-renamed copy of Ubuntu's netlib reference BLAS/LAPACK 3.10
(`mlx_cpu.libs/libblas-<hash>.so.3.10.0`, ~3 GFLOP/s). The dynamic linker resolves undefined
symbols in the global scope first, so a BLAS that exports unprefixed `cblas_sgemm` and was
dlopen'ed with RTLD_GLOBAL before libmlx.so wins for every fp32/fp64/complex64 matmul (and
LAPACK linalg) in MLX. bf16/fp16 matmuls and quantized matmuls use MLX's own kernels and are
unaffected. See docs/blas.md for the measurements.

Usage (first lines of the server entry point, before anything imports mlx):

    from model.load.blas import preload_optimized_blas
    BLAS_INFO = preload_optimized_blas(setting)  # "auto", "off", or a library path
    ...
    log.info(BLAS_INFO.log_line())

`setting`: "auto" searches (below); "off", "none" or "bundled" keeps the bundled BLAS; anything
else is the path of the library to load. The search (first that loads and passes a tiny
cblas_sgemm sanity check wins):
  1. pip wheel: `mkl` (libmkl_rt.so.N, unprefixed cblas_*), then `ngsolve-openblas` /
     `cmeel-openblas` (these two need the system libgfortran.so.5)
  2. system libs: libopenblas.so.0, libblas.so.3 (only when it resolves to
     OpenBLAS/BLIS/MKL, e.g. via Debian alternatives), libblis.so.4, libmkl_rt.so.
It only acts on Linux with the CPU-only MLX build: skipped when a `mlx-cuda*` distribution is
installed, and on macOS (Accelerate is already used). Every failure falls back silently to the
bundled BLAS; BlasInfo.reason says why.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
import sysconfig
from pathlib import Path

import attrs

__all__ = ["BlasInfo", "preload_optimized_blas", "BUNDLED_NAME", "INSTALL_HINT"]

BUNDLED_NAME = "bundled reference BLAS (slow)"
INSTALL_HINT = "apt-get install libopenblas0-pthread (or pip install mkl) for ~40x faster CPU matmuls"
AUTO = "auto"
_OFF_VALUES = {"off", "none", "bundled"}
# Symbols libmlx.so leaves undefined for BLAS; a candidate must export all of them.
_REQUIRED = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS = 101, 111

_cached: BlasInfo | None = None


@attrs.frozen
class BlasInfo:
    name: str  # "OpenBLAS 0.3.21", "Intel MKL 2025.0", "BLIS 0.9.0", or BUNDLED_NAME
    path: str | None  # the library preloaded, None for the bundled one
    reason: str  # why this one was chosen (or why nothing was preloaded)

    @property
    def optimized(self) -> bool:
        return self.path is not None

    def log_line(self) -> str:
        if self.optimized:
            return f"BLAS: {self.name} ({self.path}) [{self.reason}]"
        if self.name != BUNDLED_NAME:
            return f"BLAS: {self.name} [{self.reason}]"
        return f"BLAS: {BUNDLED_NAME} [{self.reason}] - {INSTALL_HINT}"


def preload_optimized_blas(setting: str = AUTO, *, force: bool = False) -> BlasInfo:
    """Preload an optimized BLAS with RTLD_GLOBAL so MLX's CPU backend binds to it.

    `setting`: "auto" (search), "off" / "none" / "bundled" (skip), or a library path.
    MUST be called before the first `import mlx` in the process. Idempotent (the first
    result is cached, whatever a later setting; a library cannot be unloaded anyway). Never raises.
    """
    global _cached
    if _cached is not None and not force:
        return _cached
    try:
        _cached = _preload(setting.strip())
    except Exception as e:  # never let BLAS selection break start-up
        _cached = _bundled(f"preload failed: {type(e).__name__}: {e}")
    return _cached


# -- selection ---------------------------------------------------------------------------------


def _bundled(reason: str) -> BlasInfo:
    return BlasInfo(name=BUNDLED_NAME, path=None, reason=reason)


def _preload(setting: str) -> BlasInfo:
    if not sys.platform.startswith("linux"):
        return BlasInfo(name="platform BLAS", path=None, reason=f"not Linux ({sys.platform}); nothing to do")
    if setting.lower() in _OFF_VALUES:
        return _bundled(f"disabled by the blas setting {setting!r}")
    if "mlx.core" in sys.modules:
        return _bundled("mlx was imported before preload_optimized_blas(); call it first")
    skip = _gpu_reason()
    if skip:
        return BlasInfo(name="MLX default (BLAS preload skipped)", path=None, reason=skip)

    if setting and setting.lower() != AUTO:
        info = _try_load(setting, "requested path")
        if isinstance(info, BlasInfo):
            return info
        return _bundled(f"requested BLAS {setting} unusable ({info})")

    errors: list[str] = []
    for path, source in _candidates():
        info = _try_load(path, source)
        if isinstance(info, BlasInfo):
            return info
        errors.append(f"{path}: {info}")
    if errors:
        return _bundled("no usable optimized BLAS (" + "; ".join(errors)[:300] + ")")
    return _bundled("no optimized BLAS found")


def _gpu_reason() -> str | None:
    try:
        from importlib import metadata

        for dist in metadata.distributions():
            name = (dist.name or "").lower().replace("_", "-")
            if name.startswith("mlx-cuda"):
                return f"{name} installed: MLX uses CUDA, leaving its BLAS alone"
    except Exception:
        pass
    return None


def _candidates() -> list[tuple[str, str]]:
    """(path, source) in preference order; only existing files."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(path: str | Path, source: str) -> None:
        p = str(path)
        real = os.path.realpath(p)
        if os.path.isfile(real) and real not in seen:
            seen.add(real)
            out.append((p, source))

    # pip wheels (found through their RECORD, wherever pip put them)
    for dist_name, pattern in (
        ("mkl", r"(^|/)libmkl_rt\.so(\.\d+)*$"),
        ("ngsolve-openblas", r"(^|/)libopenblas[^/]*\.so[^/]*$"),
        ("cmeel-openblas", r"(^|/)libopenblas\.so\.0$"),
    ):
        for f in _dist_files(dist_name, pattern):
            add(f, f"pip:{dist_name}")

    for d in _system_lib_dirs():
        add(os.path.join(d, "libopenblas.so.0"), "system")
        blas3 = os.path.join(d, "libblas.so.3")
        if os.path.exists(blas3) and re.search(r"openblas|blis|mkl", os.path.realpath(blas3), re.I):
            add(blas3, "system")
        add(os.path.join(d, "libblis.so.4"), "system")
        for mkl in sorted(glob.glob(os.path.join(d, "libmkl_rt.so*")), reverse=True):
            add(mkl, "system")
    return out


def _dist_files(dist_name: str, pattern: str) -> list[Path]:
    try:
        from importlib import metadata

        dist = metadata.distribution(dist_name)
        rx = re.compile(pattern)
        return sorted(
            (Path(str(dist.locate_file(f))).resolve() for f in (dist.files or []) if rx.search(str(f))),
            key=lambda p: str(p),
            reverse=True,  # libmkl_rt.so.3 before libmkl_rt.so.2
        )
    except Exception:
        return []


def _system_lib_dirs() -> list[str]:
    dirs: list[str] = []
    multiarch = sysconfig.get_config_var("MULTIARCH")
    prefixes = [os.environ.get("CONDA_PREFIX"), sys.prefix, "/usr/local", "/usr"]
    for prefix in prefixes:
        if not prefix:
            continue
        if multiarch:
            dirs.append(os.path.join(prefix, "lib", multiarch))
        dirs += [os.path.join(prefix, "lib64"), os.path.join(prefix, "lib")]
    if multiarch:
        dirs.append(os.path.join("/lib", multiarch))
    dirs += ["/usr/lib64/openblas-pthread", "/opt/OpenBLAS/lib"]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and os.path.isdir(d)]


# -- loading -----------------------------------------------------------------------------------


def _try_load(path: str, source: str) -> BlasInfo | str:
    """Load `path` with RTLD_GLOBAL after checks; BlasInfo on success, error text otherwise."""
    kind = _kind(path)
    _set_thread_env(kind)
    try:
        # RTLD_LOCAL first: a library missing the cblas symbols or failing the sanity check
        # never enters the global scope (it cannot be unloaded, but it stays invisible).
        lib = ctypes.CDLL(path, mode=os.RTLD_LAZY | getattr(os, "RTLD_LOCAL", 0))
    except OSError as e:
        return f"cannot load: {e}"
    missing = [s for s in _REQUIRED if not hasattr(lib, s)]
    if missing:
        return "missing " + ",".join(missing)
    if not _sanity_check(lib):
        return "cblas_sgemm sanity check failed"
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)  # promote to the global scope
    except OSError as e:
        return f"cannot load globally: {e}"
    return BlasInfo(name=_describe(lib, kind), path=str(path), reason=source)


def _kind(path: str) -> str:
    real = os.path.realpath(path).lower()
    for kind in ("mkl", "blis", "openblas"):
        if kind in real:
            return kind
    return "unknown"


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _set_thread_env(kind: str) -> None:
    """Default the BLAS thread count to the usable cores, never overriding the user."""
    if "OMP_NUM_THREADS" in os.environ:
        return  # the user chose; OpenBLAS/BLIS/MKL all honour it
    n = str(_cpu_count())
    if kind in ("openblas", "unknown"):
        if "GOTO_NUM_THREADS" not in os.environ:
            os.environ.setdefault("OPENBLAS_NUM_THREADS", n)
    elif kind == "blis":
        os.environ.setdefault("BLIS_NUM_THREADS", n)
    elif kind == "mkl":
        os.environ.setdefault("MKL_NUM_THREADS", n)
        if "MKL_THREADING_LAYER" not in os.environ and not _have_iomp():
            # mkl_rt's default INTEL layer needs libiomp5 (pip: intel-openmp); without it
            # fall back to GNU OpenMP when present, else sequential, instead of aborting.
            os.environ["MKL_THREADING_LAYER"] = "GNU" if _can_load("libgomp.so.1") else "SEQUENTIAL"


def _have_iomp() -> bool:
    if _can_load("libiomp5.so"):
        return True
    for d in _system_lib_dirs():  # pip's intel-openmp lands in sys.prefix/lib, off the search path
        path = os.path.join(d, "libiomp5.so")
        if os.path.exists(path):
            try:  # loaded globally, mkl_rt's later dlopen("libiomp5.so") finds it by soname
                ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
                return True
            except OSError:
                pass
    return False


def _can_load(name: str) -> bool:
    try:
        ctypes.CDLL(name, mode=os.RTLD_LAZY | getattr(os, "RTLD_LOCAL", 0))
        return True
    except OSError:
        return False


def _sanity_check(lib: ctypes.CDLL) -> bool:
    """[2x3] @ [3x2] through cblas_sgemm (row-major): catches ILP64 or broken builds."""
    f = ctypes.c_float
    a = (f * 6)(1, 2, 3, 4, 5, 6)
    b = (f * 6)(7, 8, 9, 10, 11, 12)
    c = (f * 4)(0, 0, 0, 0)
    fn = lib.cblas_sgemm
    fn.restype = None
    i = ctypes.c_int
    fn.argtypes = [i, i, i, i, i, i, f, ctypes.c_void_p, i, ctypes.c_void_p, i, f, ctypes.c_void_p, i]
    fn(_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_NO_TRANS, 2, 2, 3, 1.0, a, 3, b, 2, 0.0, c, 2)
    return list(c) == [58.0, 64.0, 139.0, 154.0]


def _describe(lib: ctypes.CDLL, kind: str) -> str:
    try:
        if hasattr(lib, "openblas_get_config"):
            lib.openblas_get_config.restype = ctypes.c_char_p
            cfg = (lib.openblas_get_config() or b"").decode(errors="replace").split()
            name = "OpenBLAS " + cfg[1] if len(cfg) > 1 and cfg[0] == "OpenBLAS" else "OpenBLAS"
            if hasattr(lib, "openblas_get_num_threads"):
                name += f", {lib.openblas_get_num_threads()} threads"
            return name
        if hasattr(lib, "mkl_get_version_string"):
            buf = ctypes.create_string_buffer(256)
            lib.mkl_get_version_string(buf, 256)
            m = re.search(r"(\d{4}(\.\d+)*)", buf.value.decode(errors="replace"))
            layer = os.environ.get("MKL_THREADING_LAYER", "INTEL")
            return f"Intel MKL {m.group(1) if m else ''}".rstrip() + f" ({layer} threading)"
        if hasattr(lib, "bli_info_get_version_str"):
            lib.bli_info_get_version_str.restype = ctypes.c_char_p
            return "BLIS " + (lib.bli_info_get_version_str() or b"").decode(errors="replace")
    except Exception:
        pass
    return {"openblas": "OpenBLAS", "blis": "BLIS", "mkl": "Intel MKL"}.get(kind, "optimized BLAS")


if __name__ == "__main__":  # python -m model.load.blas [SETTING]  -> prints what would be used
    print(preload_optimized_blas(*sys.argv[1:2]).log_line())

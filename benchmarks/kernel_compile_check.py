"""Compile the CUDA kernels of model/quant_kernel.py, model/kv/quant_kernel.py and
model/kv/paged_kernel.py with nvcc for sm_90a, without a GPU, as the server builds them: the
source model/kernels/cuda_build.py writes, or, for a body that reads a view's strides (which stays
MLX-built), as MLX's `mx.fast.cuda_kernel` writes it (its default header + ours + the generated
signature + the body). Syntax, templates and register use per configuration (ptxas -v:
registers, spills, shared memory).

    python benchmarks/kernel_compile_check.py [--mlx-src /path/to/mlx] [--only qmm|attn|paged] [--quick]

`--mlx-src`: a checkout of ml-explore/mlx (for mlx/backend/cuda/device/*.cuh), needed only by the
MLX-built kernels (skipped without it). The generated sources are written under --out (default
/tmp/kernel_check) for inspection.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import quant_kernel  # noqa: E402
from model.kernels import cuda_build  # noqa: E402

DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""


def build(
    name: str, header: str, body: str, inputs: list[tuple[str, mx.Dtype, int]], outputs: list[tuple[str, mx.Dtype]]
) -> tuple[str, bool]:
    """(source, MLX-built): cuda_build's source, or MLX's for a body that reads strides."""
    if any(f"{iname}_strides" in body for iname, _, _ in inputs):
        return build_mlx(name, header, body, inputs, outputs), True
    fname = cuda_build.function_name(name, ())
    source = cuda_build.kernel_source(
        fname, header, body, [i[0] for i in inputs], [i[1] for i in inputs], [o[0] for o in outputs],
        [o[1] for o in outputs], (),
    )  # fmt: skip
    return source, False


def build_mlx(
    name: str, header: str, body: str, inputs: list[tuple[str, mx.Dtype, int]], outputs: list[tuple[str, mx.Dtype]]
) -> str:
    """MLX's build_kernel (mlx/backend/cuda/custom_kernel.cpp), no template arguments."""
    src = DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void custom_kernel_{name}(\n"
    for iname, dtype, ndim in inputs:
        src += f"    const {cuda_build.cuda_type(dtype)}* {iname},\n"
        if ndim > 0:
            if f"{iname}_shape" in body:
                src += f"    const __grid_constant__ Shape {iname}_shape,\n"
            if f"{iname}_strides" in body:
                src += f"    const __grid_constant__ Strides {iname}_strides,\n"
            if f"{iname}_ndim" in body:
                src += f"    const __grid_constant__ int {iname}_ndim,\n"
    src += ",\n".join(f"    {cuda_build.cuda_type(d)}* {o}" for o, d in outputs) + ") {\n"
    src += body + "\n}\n\n} // namespace mlx::core::cu\n"
    # NVRTC takes the kernel's address by name (nvrtcAddNameExpression) after the source: so do we.
    src += f"\nvoid* qmm_name_probe_{name} = (void*)&mlx::core::cu::custom_kernel_{name};\n"
    return src


def compile_one(path: Path, source: tuple[str, bool], mlx_src: Path | None) -> tuple[bool | None, str]:
    """(ok, ptxas log); ok None: an MLX-built kernel without --mlx-src, not compiled."""
    src, by_mlx = source
    if by_mlx and mlx_src is None:
        return None, ""
    path.write_text(src)
    cmd = ["nvcc", "-arch=sm_90a", "-std=c++17", "--cubin", "-o", str(path.with_suffix(".cubin"))]
    cmd += [f"-I{mlx_src}"] if by_mlx else []
    res = subprocess.run([*cmd, "-Xptxas", "-v", "-w", str(path)], capture_output=True, text=True)
    return res.returncode == 0, res.stderr


def summarize(log: str) -> str:
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores", log)
    smem = re.findall(r"(\d+) bytes smem", log)
    return f"regs {','.join(regs)} spill {','.join(spill)} smem {','.join(smem)}"


def qmm_configs(quick: bool):  # type: ignore[no-untyped-def]
    for gather in (False, True):
        for dtype in (mx.bfloat16, mx.float16):
            for bits in (4, 8):
                for maxnt in (1, 8) if quick else (1, 2, 4, 8):
                    for cfg in (
                        quant_kernel.Config(8, 1, 1),
                        quant_kernel.Config(4, 2, 2),
                        quant_kernel.Config(2, 4, 4),
                    ):
                        if quick and dtype == mx.float16 and (maxnt != 8 or cfg.s != 1):
                            continue
                        yield gather, dtype, bits, maxnt, cfg


def report(name: str, ok: bool | None, log: str) -> int:
    """Print one kernel's line; 1 if it failed."""
    print(f"{'skip' if ok is None else 'ok  ' if ok else 'FAIL'} {name}: {summarize(log) if ok else ''}")
    if ok is False:
        print(log[-3000:])
    return int(ok is False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mlx-src", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("/tmp/kernel_check"))
    ap.add_argument("--only", choices=["qmm", "attn", "paged"], default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    if args.only in (None, "qmm"):
        for gather, dtype, bits, maxnt, cfg in qmm_configs(args.quick):
            name = quant_kernel._kernel_name(dtype, bits, maxnt, cfg, gather)
            header, body = quant_kernel._source(dtype, bits, maxnt, cfg, gather)
            inputs = [("x", dtype, 2), ("w", mx.uint32, 3 if gather else 2), ("scales", dtype, 3 if gather else 2)]
            inputs.append(("biases", dtype, 3 if gather else 2))
            if gather:
                inputs += [("idx", mx.uint32, 1), ("rowmap", mx.uint32, 1)]
            ok, log = compile_one(
                args.out / f"{name}.cu", build(name, header, body, inputs, [("y", dtype)]), args.mlx_src
            )
            failed += report(name, ok, log)
    if args.only in (None, "attn"):
        from model.kv import quant_kernel as kv_quant_kernel

        for name, header, body, inputs, outputs in kv_quant_kernel.compile_check_sources(args.quick):
            ok, log = compile_one(args.out / f"{name}.cu", build(name, header, body, inputs, outputs), args.mlx_src)
            failed += report(name, ok, log)
    if args.only in (None, "paged"):
        from model.kv import paged_kernel

        for name, header, body, inputs, outputs in paged_kernel.compile_check_sources(args.quick):
            ok, log = compile_one(args.out / f"{name}.cu", build(name, header, body, inputs, outputs), args.mlx_src)
            failed += report(name, ok, log)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fast paths for single ops of the decoder.

`cpu_swiglu` and `cpu_attention` speed up MLX's CPU backend (float32) and `unfused_attention` is
causal attention as plain matmuls, for prefills whose shapes rarely repeat on CUDA: each
bit-identical to the op it stands in for. `qmm_cuda` is the CUDA source of the quantized-matmul
kernel (model/quant_kernel.py), which equals MLX's op within bf16 rounding, not bit for bit.
"""

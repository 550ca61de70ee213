"""Fast paths for single ops of the decoder, each bit-identical to the op it stands in for.

`cpu_swiglu` and `cpu_attention` speed up MLX's CPU backend (float32); `unfused_attention` is
causal attention as plain matmuls, for prefills whose shapes rarely repeat on CUDA.
"""

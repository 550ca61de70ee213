"""LoRA / DoRA adapters: `mount` (wrapping a model's linears, per-row selection), `adapters` (the
engine's mounted set), `load` (mlx-lm's layout, checked against the base), `config`
(adapter_config.json field by field), `pack` (adapters side by side per product), `delta` (a
product's packed delta), `kernel` (its CUDA kernels), `ids` and `stack` (what may name an adapter,
what one row may stack; no MLX)."""

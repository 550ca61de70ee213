"""The KV cache kinds, behind one protocol (`LayerCache`, cache.py): full-precision (cache.py),
quantized (quant.py, its CUDA decode attention quant_kernel.py), sliding-window (rotating.py),
a batch whose rows turn quantized (mixed.py), recurrent states (state.py), KV shared across
layers (shared.py), a batch's rows in a block pool (paged.py, `--paged-kv`; its CUDA decode
attention paged_kernel.py); the scheme (scheme.py) and its application to rows (rows.py: when they turn,
which restored prefixes stand in for a cold run, what a batch is merged from). Code outside this
package asks caches through the protocol and never tests their class."""

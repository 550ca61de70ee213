"""Building blocks of the families' models: `language_model` (the interface every model meets,
and its `Capabilities`), `decoder` (the shared decoder), `fused_projections`, `gated_delta` (linear
attention), `tensor_parallel` (sharding a decoder)."""

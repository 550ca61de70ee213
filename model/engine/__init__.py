"""The engine: `engine` (the row calls the GPU worker drives), `build` (the one builder of an
engine), its rows (`rows` plain values, `decoding` the engine's own rows and a decode step's host
side, `params`, `sampling`), the prompt cache's engine side (`row_cache`, `snapshots`), a
prefill's bounds (`prefill_abort`, `abort_flags`, `prefill_memory`), `compiled_decode`,
`warm_up`, speculative decoding (`speculation`, `speculative_step`, `speculation_setup`), images
(`image_rows`) and embeddings (`embedding`)."""

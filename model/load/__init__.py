"""From a `--model` argument to a loaded model: `resolve` (a directory or the HF cache, offline),
`config`, `weights`, `loader`, `embedding_config` (is it an embedding model), `errors` (the one
error a directory raises), `demo` (the embedded demo model), `blas` (the CPU backend's BLAS)."""

"""Small endpoints beside generation: `routes` (the blueprint), `tokens` (/tokenize,
/detokenize, /apply-template), `fit` (GET /fit)."""

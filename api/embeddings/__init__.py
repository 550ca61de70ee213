"""OpenAI embeddings: `routes` (POST /v1/embeddings)."""

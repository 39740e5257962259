"""The engine: pure scheduling, paged KV blocks and the model runner. Knows nothing of Redis."""

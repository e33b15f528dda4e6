"""Model building blocks: paged attention backends, rotary embeddings, norms."""

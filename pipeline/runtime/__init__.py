"""demollm: a small batched generation engine with a paged KV cache."""

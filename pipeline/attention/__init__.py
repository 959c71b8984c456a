"""Cached attention: the op contract every backend shares (common.py), the paged KV cache it reads
and writes (kv_cache.py), and the backends, each a `torch.library` op with the signature of
`pipeline::cached_attention` that insert_cached_attention puts into the graph. Which backend
`attention=auto` means is decided in config.resolve_attention."""

from __future__ import annotations

import torch


def cached_attention_op(backend: str):
    """The op for an attention backend name (already resolved from `auto`)."""
    if backend == "torch":
        from pipeline.attention import torch_backend  # noqa: F401  (registers the op)

        return torch.ops.pipeline.cached_attention.default
    if backend == "triton":
        from pipeline.attention import triton_backend  # noqa: F401  (registers the op)

        return torch.ops.pipeline.cached_attention_triton.default
    if backend == "flashinfer":
        from pipeline.attention import flashinfer_backend  # noqa: F401  (registers the op)

        return torch.ops.pipeline.cached_attention_flashinfer.default
    raise ValueError(f"attention={backend} is not a backend; use torch, triton or flashinfer")

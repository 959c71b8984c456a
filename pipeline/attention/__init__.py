"""Cached attention: the op contract every backend shares (common.py), the paged KV cache it reads
and writes (kv_cache.py), and the backends, each a `torch.library` op with the signature of
`pipeline::cached_attention` that insert_cached_attention puts into the graph. Which backend
`attention=auto` means is decided in config.resolve_attention."""

from __future__ import annotations

import torch

# What each backend implements of the cached attention's options (common.py). A model whose
# attention needs another (models/masks.py: attention_options) is refused before the run, naming
# the option and the backends that have it. Sinks (gpt-oss) no backend has yet.
SUPPORTS = {
    "torch": {"sliding_window", "chunked", "bidirectional", "softcap"},
    "triton": {"sliding_window", "chunked", "bidirectional", "softcap"},
    "flashinfer": {"sliding_window", "softcap"},
}

# The ops whose work depends on the step's sequence layout (how many sequences, where each starts,
# what each has cached): piecewise capture (backends/piecewise.py) runs them eagerly between the
# captured segments, since a replay fixes every shape and address. Everything else in a cached
# graph works per token.
LAYOUT_OPS = frozenset(
    {
        "pipeline::attention_plan",
        "pipeline::cached_attention",
        "pipeline::cached_attention_triton",
        "pipeline::cached_attention_flashinfer",
    }
)


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

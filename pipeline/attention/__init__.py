"""Cached attention backends behind one interface: each registers a `torch.library` op with the
signature of `pipeline::cached_attention` (see torch_backend.py) that insert_cached_attention puts
into the graph."""

from __future__ import annotations

import importlib.util

import torch

# Backends with a cached attention op today; flashinfer is accepted by the config schema (and
# refused on CPU) but has no kernel binding yet.
IMPLEMENTED = ("torch", "triton")


def resolve(name: str, on_cuda: bool) -> str:
    """`auto`: flashinfer where installed on CUDA (once its kernel exists), else torch."""
    if name != "auto":
        return name
    installed = importlib.util.find_spec("flashinfer") is not None
    return "flashinfer" if on_cuda and installed and "flashinfer" in IMPLEMENTED else "torch"


class BackendNotImplemented(ValueError):
    pass


def cached_attention_op(backend: str):
    """The op for an attention backend name (already resolved from `auto`)."""
    if backend == "torch":
        from pipeline.attention import torch_backend  # noqa: F401  (registers the op)

        return torch.ops.pipeline.cached_attention.default
    if backend == "triton":
        from pipeline.attention import triton_backend  # noqa: F401  (registers the op)

        return torch.ops.pipeline.cached_attention_triton.default
    raise BackendNotImplemented(
        f"attention={backend} has no cached attention kernel yet; use attention=torch"
    )

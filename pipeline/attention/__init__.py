"""Cached attention backends behind one interface: each registers a `torch.library` op with the
signature of `pipeline::cached_attention` (see torch_backend.py) that insert_cached_attention puts
into the graph."""

from __future__ import annotations

import importlib.util

import torch


def resolve(name: str, on_cuda: bool) -> str:
    """`auto`: on CUDA flashinfer where installed, else triton; torch on CPU. Not torch on CUDA: a
    captured decode step needs static shapes, so there the torch backend gathers and attends over
    every page of the table (runtime.max_seq_len keys) each step, where the kernels read only the
    sequence's own pages."""
    if name != "auto":
        return name
    if not on_cuda:
        return "torch"
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


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

"""torch-cudagraph: CUDA graphs of decode steps, one per batch-size bucket.

`CUDAGraphRunner` is an nn.Module (the second seed's choice), so a profiler groups the replayed
kernels under it. It sits behind the graph module's kwargs adapter: a step whose sequences each
bring one new token (decode) is padded up to the nearest bucket, copied into static buffers and
replayed; any other step (prefill, or more tokens than the largest bucket) runs uncaptured. Padded
rows are dummy sequences of one token at position 0 whose page table points at a scratch page, so
their cache writes land nowhere that matters; outputs are sliced back to the real rows.
The KV caches are the same tensors every step, so they are static already; metadata tensors are
copied into static buffers whose contents change between replays.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

METADATA = ("qo_indptr", "cache_lens", "page_table")


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, ... up to and including max_batch_size."""
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch_size]


def pick_bucket(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n rows, or None when n is past the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def is_decode_step(inputs: dict[str, torch.Tensor]) -> bool:
    """Every sequence brings exactly one new token."""
    indptr = inputs["qo_indptr"]
    return indptr.numel() - 1 == int(indptr[-1])


def pad_step(inputs: dict[str, Any], bucket: int, scratch_page: int, table_width: int) -> dict[str, Any]:
    """A decode step of n sequences as one of `bucket` sequences (n <= bucket).

    Token tensors [1, n, ...] (or [3, 1, n] position ids) grow along the token dim; padded
    sequences have one token, nothing cached, and every page entry at the scratch page.
    """
    n = inputs["qo_indptr"].numel() - 1
    extra = bucket - n
    out = {}
    for name, value in inputs.items():
        if name == "qo_indptr":
            steps = torch.arange(1, extra + 1, dtype=value.dtype, device=value.device) + value[-1]
            out[name] = torch.cat([value, steps])
        elif name == "cache_lens":
            out[name] = torch.cat([value, value.new_zeros(extra)])
        elif name == "page_table":
            table = value.new_full((bucket, table_width), scratch_page)
            table[:n, : value.shape[1]] = torch.where(value >= 0, value, scratch_page)
            out[name] = table
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and _token_dim(value, n) is not None:
            dim = _token_dim(value, n)
            pad_shape = list(value.shape)
            pad_shape[dim] = extra
            out[name] = torch.cat([value, value.new_zeros(pad_shape)], dim=dim)
        else:
            out[name] = value  # caches and constants: the same tensors
    return out


def _token_dim(value: torch.Tensor, n: int) -> int | None:
    """The packed token dim: 1 for [1, T, ...], 2 for multimodal position ids [3, 1, T]."""
    if value.dim() == 3 and value.shape[0] == 3 and value.shape[1] == 1 and value.shape[2] == n:
        return 2
    return 1 if value.shape[0] == 1 and value.shape[1] == n else None


def slice_output(output: Any, n: int, bucket: int) -> Any:
    """Back to the n real rows: every tensor whose token dim (1) is the bucket."""
    return pytree.tree_map(
        lambda t: t[:, :n] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == bucket else t,
        output,
    )


class CUDAGraphRunner(nn.Module):
    """Replays a captured decode step per bucket; runs everything else through `forward_fn`.

    use_graphs=False runs the padded step without capture: the padding and slicing path on CPU.
    """

    def __init__(
        self,
        forward_fn: Callable[..., Any],
        buckets: list[int],
        scratch_page: int,
        table_width: int,
        use_graphs: bool = True,
        warmup: int = 2,
    ):
        super().__init__()
        self.forward_fn = forward_fn
        self.buckets = sorted(buckets)
        self.scratch_page, self.table_width = scratch_page, table_width
        self.use_graphs, self.warmup = use_graphs, warmup
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, Any], Any]] = {}
        self.replays = 0
        self.fallbacks = 0

    def forward(self, **inputs: Any) -> Any:
        if not is_decode_step(inputs):
            self.fallbacks += 1
            return self.forward_fn(**inputs)
        n = inputs["qo_indptr"].numel() - 1
        bucket = pick_bucket(n, self.buckets)
        if bucket is None:
            self.fallbacks += 1
            return self.forward_fn(**inputs)
        padded = pad_step(inputs, bucket, self.scratch_page, self.table_width)
        if not self.use_graphs:
            return slice_output(self.forward_fn(**padded), n, bucket)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(padded)
        graph, static_inputs, static_output = self.graphs[bucket]
        for name, value in padded.items():
            buffer = static_inputs[name]
            if isinstance(buffer, torch.Tensor) and buffer.data_ptr() != value.data_ptr():
                buffer.copy_(value)
        graph.replay()
        self.replays += 1
        return slice_output(static_output, n, bucket)

    def _capture(self, padded: dict[str, Any]):
        # Static copies of every step input; the caches are the engine's own tensors (static already).
        static = {
            k: (v.clone() if isinstance(v, torch.Tensor) and not k.startswith("kv_cache") else v)
            for k, v in padded.items()
        }
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # warm-up outside the graph (allocator, autotuning)
                self.forward_fn(**static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self.forward_fn(**static)
        return graph, static, output

    def memory_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for _, s, _ in self.graphs.values()
            for k, t in s.items()
            if isinstance(t, torch.Tensor) and not k.startswith("kv_cache")
        )


def install(graph: nn.Module, cfg_runtime, buckets: list[int] | None, use_graphs: bool) -> CUDAGraphRunner:
    """Put a runner behind a cached graph module's kwargs adapter, as its submodule (profilers see
    it). The scratch page and page-table width follow the runtime config the engine's cache uses."""
    from pipeline.runtime.kv_cache import pages_for

    runner = CUDAGraphRunner(
        graph.forward,
        sorted(buckets or default_buckets(cfg_runtime.max_batch_size)),
        scratch_page=pages_for(cfg_runtime, graph.cache_specs) - 1,
        table_width=-(-cfg_runtime.max_seq_len // cfg_runtime.attn_page_size),
        use_graphs=use_graphs,
    )
    graph.add_module("cuda_graph_runner", runner)
    graph.forward = lambda **inputs: graph.cuda_graph_runner(**inputs)
    return runner

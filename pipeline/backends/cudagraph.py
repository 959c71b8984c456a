"""torch-cudagraph: CUDA graphs of decode steps, one per batch-size bucket.

`CUDAGraphRunner` is an nn.Module (the second seed's choice), so a profiler groups the replayed
kernels under it. It sits behind the graph module's kwargs adapter: a step whose sequences each
bring one new token (decode) is copied into the static input buffers of the nearest bucket and
replayed; any other step (prefill, or more sequences than the largest bucket) runs uncaptured.
Padded rows are dummy sequences of one token at position 0 whose page table points at a scratch
page, so their cache writes land nowhere that matters; outputs are sliced back to the real rows.
The KV caches are the same tensors every step, so they are static already. A replay costs one
copy per changing input (at batch 1: token embeddings, positions, cache lengths, page table) and
never reads a device value on the host.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeline.attention.kv_cache import pages_for
from pipeline.config import BackendConfig, RuntimeConfig
from pipeline.graphs import record_of


def default_buckets(largest: int) -> list[int]:
    """1, 2, 4, 8, ... up to and including `largest` (runtime.max_batch_size for decode batches,
    runtime.max_num_tokens for piecewise token buckets)."""
    buckets, b = [], 1
    while b < largest:
        buckets.append(b)
        b *= 2
    return buckets + [largest]


def token_buckets(backend: BackendConfig, runtime: RuntimeConfig) -> list[int]:
    """The token buckets piecewise capture runs segments at: backend.piecewise_tokens, else 1, 2,
    4, ... runtime.max_num_tokens (the memory check and the installer read the same list)."""
    return backend.piecewise_tokens or default_buckets(runtime.max_num_tokens)


def pick_bucket(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n rows, or None when n is past the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def step_shape(inputs: dict[str, Any]) -> tuple[int, int]:
    """(sequences, packed tokens) of a step, from shapes alone: reading a value would make the host
    wait for the device before every step."""
    sequences = inputs["qo_indptr"].shape[0] - 1
    if "position_ids" in inputs:
        return sequences, inputs["position_ids"].shape[-1]  # [1, T] or [3, 1, T]
    return sequences, next(inputs[k].shape[1] for k in ("input_ids", "inputs_embeds") if k in inputs)


def token_dim(value: torch.Tensor, n: int) -> int | None:
    """The packed token dim: 1 for [1, T, ...], 2 for multimodal position ids [3, 1, T]."""
    if value.dim() == 3 and value.shape[0] == 3 and value.shape[1] == 1 and value.shape[2] == n:
        return 2
    return 1 if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == n else None


class StaticStep:
    """One bucket's decode inputs at fixed addresses, the ones a captured graph reads.

    Padded rows are sequences of one token at position 0 with nothing cached, their page table row
    at the scratch page; `fill` copies a step of n <= bucket sequences into the first n rows and
    resets the rest. KV caches are the engine's own tensors (static already). In decode, qo_indptr
    is always 0, 1, ..., bucket.
    """

    def __init__(
        self, inputs: dict[str, Any], bucket: int, scratch_page: int, table_width: int, caches: frozenset[str]
    ):
        self.bucket, self.scratch_page, self.caches = bucket, scratch_page, caches
        n = inputs["qo_indptr"].shape[0] - 1
        self.buffers: dict[str, Any] = {}
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor) or name in caches:
                buffer = value
            elif name == "qo_indptr":
                buffer = torch.arange(bucket + 1, dtype=value.dtype, device=value.device)
            elif name == "cache_lens":
                buffer = value.new_zeros(bucket)
            elif name == "page_table":
                buffer = value.new_full((bucket, table_width), scratch_page)
            elif name == "token_block":  # [T, 2]: a decode token is in no bidirectional block
                buffer = value.new_zeros(bucket, 2)
            elif (dim := token_dim(value, n)) is not None:
                buffer = value.new_zeros(value.shape[:dim] + (bucket,) + value.shape[dim + 1 :])
            else:
                buffer = value.clone()
            self.buffers[name] = buffer

    def fill(self, inputs: dict[str, Any]) -> None:
        n = inputs["qo_indptr"].shape[0] - 1
        padded = n < self.bucket
        for name, value in inputs.items():
            buffer = self.buffers[name]
            # token_block: zeros in every decode step (generated tokens are in no block), so no copy
            if not isinstance(value, torch.Tensor) or buffer is value or name in ("qo_indptr", "token_block"):
                continue
            if name == "cache_lens":
                buffer[:n].copy_(value)
                if padded:  # rows a larger step left behind
                    buffer[n:].zero_()
            elif name == "page_table":
                buffer[:n, : value.shape[1]].copy_(value)  # entries past a row's pages are never read
                if padded:  # a padded row writes its one token into its first page: the scratch page
                    buffer[n:, 0].fill_(self.scratch_page)
            elif (dim := token_dim(value, n)) is not None:
                buffer.narrow(dim, 0, n).copy_(value)  # padded rows' tokens: any finite values serve
            else:
                buffer.copy_(value)

    def bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for name, t in self.buffers.items()
            if isinstance(t, torch.Tensor) and name not in self.caches
        )


def slice_output(output: Any, n: int, bucket: int) -> Any:
    """Back to the n real rows: every tensor whose token dim (1) is the bucket."""
    if n == bucket:
        return output
    return pytree.tree_map(
        lambda t: t[:, :n] if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == bucket else t,
        output,
    )


class CUDAGraphRunner(nn.Module):
    """Replays a captured decode step per bucket; runs everything else through `forward_fn`.

    use_graphs=False runs the bucket's static step without capture: the padding and slicing path
    on CPU.
    """

    def __init__(
        self,
        forward_fn: Callable[..., Any],
        buckets: list[int],
        scratch_page: int,
        table_width: int,
        caches: frozenset[str],
        use_graphs: bool = True,
        warmup: int = 2,
    ):
        """caches: the KV cache inputs' names (the engine's own tensors, static already)."""
        super().__init__()
        self.forward_fn = forward_fn
        self.buckets = sorted(buckets)
        self.scratch_page, self.table_width, self.caches = scratch_page, table_width, caches
        self.use_graphs, self.warmup = use_graphs, warmup
        self.steps: dict[int, StaticStep] = {}  # bucket -> its input buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}  # bucket -> graph, its output
        self.replays = 0
        self.fallbacks = 0
        self.pool_bytes = 0  # device memory the captures reserved (their private pools: activations)

    def forward(self, **inputs: Any) -> Any:
        n, tokens = step_shape(inputs)
        bucket = pick_bucket(n, self.buckets) if n == tokens else None
        if bucket is None:  # prefill, or more sequences than the largest bucket
            self.fallbacks += 1
            return self.forward_fn(**inputs)
        if bucket not in self.steps:
            self.steps[bucket] = StaticStep(inputs, bucket, self.scratch_page, self.table_width, self.caches)
        step = self.steps[bucket]
        step.fill(inputs)
        if not self.use_graphs:
            return slice_output(self.forward_fn(**step.buffers), n, bucket)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(step.buffers)
        graph, output = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return slice_output(output, n, bucket)

    def _capture(self, buffers: dict[str, Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # warm-up outside the graph (allocator, autotuning)
                self.forward_fn(**buffers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        reserved = torch.cuda.memory_reserved()
        with torch.cuda.graph(graph):
            output = self.forward_fn(**buffers)
        self.pool_bytes += torch.cuda.memory_reserved() - reserved
        return graph, output

    def memory_bytes(self) -> int:
        """The static input buffers of every bucket (the graphs' own pools are `pool_bytes`)."""
        return sum(step.bytes() for step in self.steps.values())


def install(
    graph: nn.Module, runtime: RuntimeConfig, buckets: list[int] | None, use_graphs: bool
) -> CUDAGraphRunner:
    """Put a runner behind a cached graph module's kwargs adapter, as its submodule (profilers see
    it). The scratch page and page-table width follow the runtime config the engine's cache uses."""
    specs = record_of(graph).cache_specs
    runner = CUDAGraphRunner(
        graph.forward,
        sorted(buckets or default_buckets(runtime.max_batch_size)),
        scratch_page=pages_for(runtime, specs) - 1,
        table_width=-(-runtime.max_seq_len // runtime.attn_page_size),
        caches=frozenset(spec.input_name for spec in specs),
        use_graphs=use_graphs,
    )
    graph.add_module("cuda_graph_runner", runner)
    graph.forward = lambda **inputs: graph.cuda_graph_runner(**inputs)
    return runner

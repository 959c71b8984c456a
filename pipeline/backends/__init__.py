"""Capture backends: how each captured subgraph runs (never the eager parts).

torch-simple runs the graph as exported and transformed; torch-compile compiles it with Inductor
(dynamic shapes); torch-cudagraph replays CUDA graphs of its decode steps per batch bucket
(CUDAGraphRunner); torch-opt compiles, then captures the compiled graph. With capture=none there
is no subgraph: torch-simple runs the eager model and torch-compile compiles the whole eager model.
With backend.piecewise=true every other step runs the graph's segments per token bucket
(PiecewiseRunner, piecewise.py), in front of what the backend made of the whole graph.
"""

from __future__ import annotations

from torch import nn

from pipeline.attention.kv_cache import pages_for
from pipeline.backends import cudagraph, piecewise
from pipeline.backends.compile import compile_module
from pipeline.config import BackendConfig, RuntimeConfig
from pipeline.graphs import record_of


class NoCachedGraph(ValueError):
    """A CUDA-graph backend needs a cached graph: decode steps are what it captures."""


COMPILING = ("torch-compile", "torch-opt")
CAPTURING = ("torch-cudagraph", "torch-opt")


def apply(
    backend: str,
    targets: list[tuple[str, nn.Module]],
    runtime: RuntimeConfig,
    config: BackendConfig,
    on_cuda: bool,
) -> dict[str, nn.Module]:
    """Put `backend` on each target module (a captured graph, or the eager model with capture=none);
    returns the runners installed (CUDAGraphRunner, PiecewiseRunner), by target name.
    torch-simple changes nothing."""
    runners: dict[str, nn.Module] = {}
    if backend in COMPILING:
        for _, target in targets:
            compile_module(target)
    cached = [(name, g) for name, g in targets if _has_cache(g)]
    if backend in CAPTURING or config.piecewise:
        if not cached:
            raise NoCachedGraph(
                f"backend={backend}{' backend.piecewise=true' if config.piecewise else ''} captures steps of "
                "a cached graph, and there is none: enable transforms.insert_cached_attention"
            )
    for name, graph in cached:
        if backend in CAPTURING:
            runners[name] = cudagraph.install(
                graph, runtime, config.cuda_graph_batch_sizes, use_graphs=on_cuda
            )
        if config.piecewise:
            specs = record_of(graph).cache_specs
            runners[f"{name} (piecewise)"] = piecewise.install(
                graph,
                config.piecewise_tokens or cudagraph.default_buckets(runtime.max_num_tokens),
                scratch_page=pages_for(runtime, specs) - 1,
                page_size=runtime.attn_page_size,
                capture_head=config.piecewise_capture_lm_head,
                compile_segment=compile_module if backend in COMPILING else None,
                use_graphs=on_cuda and backend in CAPTURING,
                max_tokens=runtime.max_num_tokens,
            )
    return runners


def _has_cache(target: nn.Module) -> bool:
    try:
        return record_of(target).has_cache
    except KeyError:  # the eager model (capture=none)
        return False


def remove(targets: list[tuple[str, nn.Module]]) -> None:
    """Undo `apply`: each target's class forward shows again, and its CUDA graph runner goes."""
    for _, target in targets:
        target.__dict__.pop("forward", None)
        target._modules.pop("cuda_graph_runner", None)
        target._modules.pop("piecewise_runner", None)

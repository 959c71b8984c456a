"""Capture backends: how each captured subgraph runs (never the eager parts).

torch-simple runs the graph as exported and transformed; torch-compile compiles it with Inductor
(dynamic shapes); torch-cudagraph replays CUDA graphs of its decode steps per batch bucket
(CUDAGraphRunner); torch-opt compiles, then captures the compiled graph. With capture=none there
is no subgraph: torch-simple runs the eager model and torch-compile compiles the whole eager model.
"""

from __future__ import annotations

from torch import nn

from pipeline.backends import cudagraph
from pipeline.backends.compile import compile_module
from pipeline.config import RuntimeConfig
from pipeline.graphs import record_of


class NoCachedGraph(ValueError):
    """A CUDA-graph backend needs a cached graph: decode steps are what it captures."""


def apply(
    backend: str,
    targets: list[tuple[str, nn.Module]],
    runtime: RuntimeConfig,
    buckets: list[int] | None,
    on_cuda: bool,
) -> dict[str, cudagraph.CUDAGraphRunner]:
    """Put `backend` on each target module (a captured graph, or the eager model with capture=none);
    returns the CUDA graph runners installed, by target name. torch-simple changes nothing."""
    runners = {}
    if backend in ("torch-compile", "torch-opt"):
        for _, target in targets:
            compile_module(target)
    if backend in ("torch-cudagraph", "torch-opt"):
        cached = [(name, g) for name, g in targets if _has_cache(g)]
        if not cached:
            raise NoCachedGraph(
                f"backend={backend} captures decode steps of a cached graph, and there is none: "
                "enable transforms.insert_cached_attention"
            )
        for name, graph in cached:
            runners[name] = cudagraph.install(graph, runtime, buckets, use_graphs=on_cuda)
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

"""Putting a backend on the captured graphs (or on the eager model with capture=none) and taking it
off: what each does is its spec's (pipeline/backends/__init__.py)."""

from __future__ import annotations

from functools import partial

from torch import nn

from pipeline.attention.kv_cache import pages_for
from pipeline.backend_specs import spec
from pipeline.backends import cudagraph, piecewise
from pipeline.backends.compile import compile_module
from pipeline.config import BackendConfig, RuntimeConfig
from pipeline.graphs import record_of


class NoCachedGraph(ValueError):
    """A CUDA-graph backend needs a cached graph: decode steps are what it captures."""


def apply(
    backend: str,
    targets: list[tuple[str, nn.Module]],
    runtime: RuntimeConfig,
    config: BackendConfig,
    on_cuda: bool,
) -> dict[str, nn.Module]:
    """Put `backend` on each target module (a captured graph, or the eager model with capture=none);
    returns the runners installed (CUDAGraphRunner, PiecewiseRunner), by target name.
    A backend that neither compiles nor replays changes nothing."""
    runners: dict[str, nn.Module] = {}
    traits = spec(backend)
    if traits.compiles:
        for name, target in targets:
            compile_module(target, name)
    cached = [(name, g) for name, g in targets if _has_cache(g)]
    if traits.replays or config.piecewise:
        if not cached:
            raise NoCachedGraph(
                f"backend={backend}{' backend.piecewise=true' if config.piecewise else ''} captures steps of "
                "a cached graph, and there is none: enable transforms.insert_cached_attention"
            )
    for name, graph in cached:
        if traits.replays:
            runners[name] = cudagraph.install(
                graph, runtime, config.cuda_graph_batch_sizes, use_graphs=on_cuda
            )
        if config.piecewise:
            specs = record_of(graph).cache_specs
            runners[f"{name} (piecewise)"] = piecewise.install(
                graph,
                cudagraph.token_buckets(config, runtime),
                scratch_page=pages_for(runtime, specs) - 1,
                page_size=runtime.attn_page_size,
                capture_head=config.piecewise_capture_lm_head,
                compile_segment=partial(_compile_segment, name) if traits.compiles else None,
                use_graphs=on_cuda and traits.replays,
                max_tokens=runtime.max_num_tokens,
            )
    return runners


def _compile_segment(graph: str, segment: nn.Module, part: str) -> None:
    compile_module(segment, f"{graph}/{part}")


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

"""How a profile sees inside each backend's captured graphs, for the profiled windows only.

- torch-simple: the graph runs its own forward, so module ranges go into it (ranges.py).
- torch-compile: each graph's forward is swapped for a profiled variant compiled with named kernels
  and provenance (provenance.py); its kernels and extern calls are mapped to modules afterwards.
- torch-cudagraph, torch-opt: the steps that run uncaptured (prefill) run the graph with ranges,
  or the profiled variant under torch-opt; every captured bucket's kernels are recorded once with
  their modules, outside the graph, and each replay is matched to that sequence (cudagraphs.py).
- backend.piecewise=true: the same per segment. Each static segment runs its own profiled variant
  (compiling backends) or has ranges; each segment graph a bucket captured is recorded and its
  replays matched like the decode graphs'; the layout segments, which run eagerly, have ranges.
Everything is undone on exit: the timed runs keep running what the capture stage built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import fx, nn

from pipeline.backend_specs import spec
from pipeline.graphs import find_graphs
from pipeline.profiler import cudagraphs, events, provenance, ranges
from pipeline.profiler.ranges import module_ranges


@dataclass
class Instrumentation:
    ranges: list[str] = field(default_factory=list)  # graphs with module ranges
    recorders: list[provenance.ProvenanceRecorder] = field(default_factory=list)
    sequences: list[list[tuple[str, cudagraphs.Stack]]] = field(default_factory=list)  # per captured bucket

    @property
    def graphs(self) -> dict[int, provenance.GraphSites]:
        return {gid: sites for r in self.recorders for gid, sites in r.graphs.items()}

    def apply(self, window: events.Window) -> dict[str, int]:
        """Attribute the window's compiled calls and replays; returns the counts of calls mapped to a
        module and left unattributed, per way."""
        counts = {}
        if self.recorders:
            found = provenance.attribute(window, self.graphs)
            window.modules += found.spans
            on_device = provenance.attribute_device(window, self.graphs)
            counts |= {
                "inductor_provenance": found.attributed + on_device[0],
                "inductor_unattributed": found.unattributed + on_device[1],
                "inductor_majority_rule": found.majority,
            }
        if self.sequences:
            attributed, unattributed = cudagraphs.attribute(window, self.sequences)
            counts |= {"cudagraph_sequence": attributed, "cudagraph_unattributed": unattributed}
        return counts


def _runners(model: nn.Module) -> list:
    from pipeline.backends.cudagraph import CUDAGraphRunner

    return [m for m in model.modules() if isinstance(m, CUDAGraphRunner)]


def _piecewise(graph: nn.Module):
    from pipeline.backends.piecewise import PiecewiseRunner

    return next((m for m in graph.modules() if isinstance(m, PiecewiseRunner)), None)


@contextmanager
def _ranges_in(segment: fx.GraphModule, prefix: str) -> Iterator[None]:
    added = ranges.instrument(segment, prefix)
    try:
        yield
    finally:
        ranges.remove(segment, added)


def _instrument_segments(
    runner, prefix: str, backend: str, stack: ExitStack, instrumentation: Instrumentation, variants: bool
) -> None:
    """Each segment of a piecewise runner seen as the graph is: static segments through a profiled
    variant of their own (compiling backends; none when `variants` is off) or module ranges, layout
    segments through ranges."""
    for name, segment in runner.split_graph.named_children():
        wrapper = runner.segments.get(name)
        if runner.kinds[name] == "layout" or not spec(backend).compiles:
            stack.enter_context(_ranges_in(segment, prefix))
            continue
        if not variants:
            continue
        recorder = provenance.ProvenanceRecorder(segment, prefix)
        instrumentation.recorders.append(recorder)
        variant = torch.compile(type(segment).forward.__get__(segment), dynamic=True, backend=recorder)
        stack.enter_context(_swapped(wrapper or segment, "forward", variant))


@contextmanager
def _swapped(owner, attribute: str, value) -> Iterator[None]:
    """owner.<attribute> = value for the duration (an instance attribute: the class's shows again)."""
    had = attribute in owner.__dict__
    before = owner.__dict__.get(attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, attribute, before)
        else:
            delattr(owner, attribute)


def _record_sequences(model: nn.Module, instrumentation: Instrumentation) -> None:
    """Each captured bucket's kernels, with their modules, from one uncaptured run of the same
    step on the bucket's buffers (ranges or the profiled variant tell the modules)."""
    from torch.profiler import ProfilerActivity, profile

    names = {id(m): name for name, m in model.named_modules()}
    calls = [
        partial(runner.forward_fn, **runner.steps[bucket].buffers)
        for runner in _runners(model)
        for bucket in sorted(runner.graphs)
    ]
    from pipeline.backends.piecewise import runners as piecewise_runners

    calls += [
        partial(segment.forward, *inputs)
        for runner in piecewise_runners(model)
        for segment in runner.segments.values()
        for _, inputs, _ in segment.graphs.values()
    ]
    for call in calls:
        with torch.no_grad():  # compiles a profiled variant outside the recording
            call()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.no_grad():
                call()
            torch.cuda.synchronize()
        window = events.read_window(prof, names)
        if instrumentation.recorders:
            provenance.attribute_device(window, instrumentation.graphs)
        instrumentation.sequences.append(cudagraphs.recorded(window))


@contextmanager
def instrumented(
    model: nn.Module, backend: str, on_cuda: bool, kernel_provenance: bool = True
) -> Iterator[Instrumentation]:
    """kernel_provenance=False: compiled graphs run as the capture stage built them (their kernels
    stay with the graph module); ranges and replay sequences as the backend has them."""
    instrumentation = Instrumentation()
    with ExitStack() as stack:
        if not spec(backend).compiles:
            instrumentation.ranges = stack.enter_context(module_ranges(model))
        for path, graph in find_graphs(model):
            prefix = "" if path == "root" else path
            piecewise = _piecewise(graph)
            if piecewise is not None:
                _instrument_segments(piecewise, prefix, backend, stack, instrumentation, kernel_provenance)
            if not spec(backend).compiles or not kernel_provenance:
                continue
            recorder = provenance.ProvenanceRecorder(graph, prefix)
            instrumentation.recorders.append(recorder)
            # The class's forward is the graph's own code; the variant compiles it afresh (a
            # backend of its own: Dynamo keeps the timed variant's cache entry apart).
            variant = torch.compile(type(graph).forward.__get__(graph), dynamic=True, backend=recorder)
            runner = next((r for r in _runners(graph)), None)
            if runner is not None:  # torch-opt: the steps the runner does not replay
                stack.enter_context(_swapped(runner, "forward_fn", variant))
            elif piecewise is not None:  # torch-compile: the steps the segments leave to the graph
                stack.enter_context(_swapped(piecewise, "full_fn", variant))
            else:
                stack.enter_context(_swapped(graph, "forward", variant))
        if spec(backend).replays and on_cuda:
            _record_sequences(model, instrumentation)
        yield instrumentation

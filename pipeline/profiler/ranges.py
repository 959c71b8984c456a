"""Module ranges inside exported graphs, so a profile of a captured model has the same module tree
as eager.

An exported GraphModule runs no nn.Module calls, but export keeps each node's `nn_module_stack`
(the modules it was traced under, outermost first). For a profiling window, `module_ranges` puts
`profiler::_record_function_enter_new` / `_record_function_exit` around each run of nodes that
share a stack, named `module::<fqn>|<Class>`, and takes them out afterwards: timed runs never pay
for them. Nodes without a stack (inserted by a transform and given none) and getitem nodes (no op
runs; a fused GEMM's parts keep their projection's stack) stay in the ranges open around them.

The eager modules around the graphs (embeddings, vision tower, lm_head) get the same ranges from a
forward pre/post hook pair (`eager_module_ranges`), so Perfetto and HTA name them by path, not as
`nn.Module: Linear_3`; the reader keeps one span per module (events.py).

Only the graph's own forward is rewritten: a compiled forward (torch-compile) or a CUDA graph
replay (torch-cudagraph, torch-opt) keeps running the code it was built from, so under those
backends a graph shows as one module, as the seed's profiler shows a CUDAGraphRunner.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import fx, nn

from pipeline.graphs import EXPORT_PLACEHOLDER, find_graphs, range_name

ENTER = torch.ops.profiler._record_function_enter_new.default
EXIT = torch.ops.profiler._record_function_exit._RecordFunction


# The stack export gives nodes it adds itself (shape guards); no module ran them.


def node_stack(node: fx.Node) -> list[tuple[str, str, str]] | None:
    """(key, module path, class name) of each module the node ran under, below the graph's root."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return [
        (key, path, cls.rsplit(".", 1)[-1])
        for key, (path, cls) in stack.items()
        if path and path != EXPORT_PLACEHOLDER
    ]


def instrument(gm: fx.GraphModule, prefix: str) -> list[fx.Node]:
    """Put the ranges in (and recompile); returns the nodes added, for `remove`."""
    graph = gm.graph
    added: list[fx.Node] = []
    open_: list[tuple[str, fx.Node]] = []  # (stack key, enter node), outermost first

    def close(down_to: int, before: fx.Node) -> None:
        while len(open_) > down_to:
            _, handle = open_.pop()
            with graph.inserting_before(before):
                added.append(graph.call_function(EXIT, (handle,)))

    for node in list(graph.nodes):
        if node.op == "output":
            close(0, node)
            break
        if (
            node.op != "call_function"
            or node.target is operator.getitem
            or (stack := node_stack(node)) is None
        ):
            continue
        shared = 0
        while shared < min(len(open_), len(stack)) and open_[shared][0] == stack[shared][0]:
            shared += 1
        close(shared, node)
        for key, path, cls in stack[shared:]:
            fqn = f"{prefix}.{path}" if prefix else path
            with graph.inserting_before(node):
                handle = graph.call_function(ENTER, (range_name(fqn, cls), None))
            added.append(handle)
            open_.append((key, handle))
    gm.recompile()
    return added


def remove(gm: fx.GraphModule, added: list[fx.Node]) -> None:
    for node in reversed(added):  # exits (users of the handles) were added after their enters
        gm.graph.erase_node(node)
    gm.recompile()


@contextmanager
def module_ranges(model: nn.Module) -> Iterator[list[str]]:
    """Every captured graph of the model instrumented for the duration; yields their paths."""
    graphs = [(path, gm) for path, gm in find_graphs(model)]
    added = [instrument(gm, "" if path == "root" else path) for path, gm in graphs]
    try:
        yield [path for path, _ in graphs]
    finally:
        for (_, gm), nodes in zip(graphs, added, strict=True):
            remove(gm, nodes)


def _eager_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module below the root that runs as itself: not one inside a captured graph (a
    GraphModule's submodules run inside its code, where the graph's own ranges name them). The
    root has no path to name it by; its call event names its class."""
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(module, fx.GraphModule):
            inside.append(f"{name}." if name else "")
        if name:
            yield name, module


@contextmanager
def eager_module_ranges(model: nn.Module) -> Iterator[int]:
    """A `module::<fqn>|<Class>` range around each eager module's forward for the duration (hooks
    removed after); yields how many modules got one."""
    handles = []

    def hooks(fqn: str, module: nn.Module):
        name, open_ = range_name(fqn, type(module).__name__), []

        def enter(_module, _args):
            open_.append(ENTER(name, None))

        def leave(_module, _args, _output):
            if open_:
                EXIT(open_.pop())

        return enter, leave

    for fqn, module in _eager_modules(model):
        enter, leave = hooks(fqn, module)
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield len(handles) // 2
    finally:
        for handle in handles:
            handle.remove()

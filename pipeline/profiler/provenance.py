"""Which modules Inductor's kernels compute: a compiled graph seen module by module.

A compiled forward runs Inductor's generated code, not the graph's nodes, so module ranges in the
graph (ranges.py) would change what is compiled. Instead a second, profiled variant of each graph
is compiled through `ProvenanceRecorder`, a torch.compile backend that runs Inductor with
`cpp.enable_kernel_profile` (each generated C++ kernel a named profiler event,
`graph_<id>_cpp_fused_...`) and `trace.provenance_tracking_level=1`, which reports, per compiled
graph, the kernels and extern calls in the order the generated code runs them
(`cppCodeToPost`: `<kernel>:<n>`, extern calls as `torch.ops.<ns>.<op>.<overload>:<n>`), the
post-grad nodes each computes, and their pre-grad nodes (`postToPre`). The pre-grad graph is
Dynamo's trace of the exported graph's forward: its nodes carry the exported nodes' names (or, when
Dynamo renamed one, the exported line in their stack trace), and through them each exported node's
`nn_module_stack`. What the timed runs execute is the other variant, compiled as the capture
stage compiled it; this one only runs in the profiled windows (its overhead: `profile/overhead_ratio`).

A kernel whose nodes come from several modules (Inductor fuses a residual add of one layer with the
next layer's norm) goes to the module most of its nodes sit in; on a tie, to the module of its last
node in graph order, the one whose output it writes (`rule: majority`). A kernel or call whose
nodes carry no module stack stays with the graph module itself (`unattributed` inside it).

The private pieces (the trace logger, Inductor's graph counter) are used here only.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field

from torch import fx

from pipeline.profiler.events import ModuleSpan, OpEvent, Window
from pipeline.profiler.ranges import node_stack

Stack = tuple[tuple[str, str], ...]  # (fqn, class) of each module, outermost first

MAPPINGS = "inductor_provenance_tracking_node_mappings"
CALL_PREFIX = "## Call CompiledFxGraph"  # the op event Inductor's wrapper opens around a graph's code
KERNEL = re.compile(r"^graph_(\d+)_(.+)$")


@dataclass
class Site:
    """A kernel or extern call of a compiled graph, in the order the generated code runs them."""

    event: str  # its profiler event: the kernel's name (without graph_<id>_) or `<ns>::<op>`
    stack: Stack  # the module it computes for; () when its nodes carry no stack
    rule: str  # single (its nodes sit in one module) | majority | none
    absorbed: tuple[str, ...] = ()  # under `majority`: the other modules whose nodes it computes


@dataclass
class GraphSites:
    graph_id: int
    sites: list[Site] = field(default_factory=list)


def _event_name(entry: str) -> str:
    """`cpp_fused_x_0` -> itself; `torch.ops.pipeline.rms_norm.default` -> `pipeline::rms_norm`;
    `extern_kernels.mm` -> `aten::mm`."""
    if entry.startswith("torch.ops."):
        namespace, op = entry.split(".")[2:4]
        return f"{namespace}::{op}"
    if entry.startswith("extern_kernels."):
        return "aten::" + entry.split(".", 1)[1]
    return entry


def _node_stacks(exported: fx.GraphModule, prefix: str) -> dict[str, Stack]:
    """Exported node name -> its module stack (fully qualified under the graph's path)."""
    stacks = {}
    for node in exported.graph.nodes:
        stack = node_stack(node)
        if stack:
            stacks[node.name] = tuple((f"{prefix}.{path}" if prefix else path, cls) for _, path, cls in stack)
    return stacks


_ASSIGNED = re.compile(r"^\s*(\w+)(?:\s*,\s*\w+)*\s*=")


def _exported_name(node: fx.Node, exported_names: set[str]) -> str | None:
    """The exported node a pre-grad node traces: the same name, or the variable its stack trace's
    last line assigns (Dynamo renames a node whose name it already used)."""
    if node.name in exported_names:
        return node.name
    lines = [line for line in (node.meta.get("stack_trace") or "").splitlines() if line.strip()]
    match = _ASSIGNED.match(lines[-1]) if lines else None
    return match.group(1) if match and match.group(1) in exported_names else None


def sites_of(mappings: dict, pre_grad: fx.GraphModule, stacks: dict[str, Stack]) -> list[Site]:
    """The sites of one compiled graph from its provenance mappings."""
    order = {node.name: i for i, node in enumerate(pre_grad.graph.nodes)}
    names = {node.name: _exported_name(node, set(stacks)) for node in pre_grad.graph.nodes}
    post_to_pre = mappings.get("postToPre", {})
    entries = sorted(mappings.get("cppCodeToPost", {}).items(), key=lambda kv: int(kv[0].rsplit(":", 1)[1]))
    sites = []
    for entry, post_nodes in entries:
        pre = sorted(
            {p for post in post_nodes for p in post_to_pre.get(post, [])}, key=lambda n: order.get(n, -1)
        )
        found = [stacks[names[p]] for p in pre if names.get(p) in stacks]
        if not found:
            sites.append(Site(_event_name(entry.rsplit(":", 1)[0]), (), "none"))
            continue
        counts = Counter(found)
        best = max(counts.values())
        winners = [s for s in found if counts[s] == best]
        stack = winners[-1]  # the tie goes to the last node's module: the output the kernel writes
        absorbed = tuple(dict.fromkeys(s[-1][0] for s in found if s != stack))
        rule = "single" if len(counts) == 1 else "majority"
        sites.append(Site(_event_name(entry.rsplit(":", 1)[0]), stack, rule, absorbed))
    return sites


def fused_modules(graphs: dict[int, GraphSites]) -> dict[str, set[str]]:
    """Module -> the modules whose kernels compute some of its nodes (by the majority rule), over
    every compiled graph: where Inductor moved a module's work into another's kernels."""
    into: dict[str, set[str]] = {}
    for graph in graphs.values():
        for site in graph.sites:
            for fqn in site.absorbed:
                into.setdefault(fqn, set()).add(site.stack[-1][0])
    return into


class ProvenanceRecorder:
    """A torch.compile backend for the profiled variant of one exported graph: Inductor with named
    kernels and provenance tracking, and the sites of every graph it compiles, by graph id."""

    def __init__(self, exported: fx.GraphModule, prefix: str):
        self.stacks = _node_stacks(exported, prefix)
        self.graphs: dict[int, GraphSites] = {}

    def __call__(self, pre_grad: fx.GraphModule, example_inputs):
        import torch._inductor.compile_fx as compile_fx
        from torch._inductor import config
        from torch._logging._internal import trace_log

        payloads: list[str] = []

        class Capture(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                artifact = (getattr(record, "metadata", None) or {}).get("artifact") or {}
                if artifact.get("name") == MAPPINGS:
                    payloads.append(record.payload)

        graph_id = next(copy.copy(compile_fx._graph_counter))  # the id Inductor gives this compile
        handler, level = Capture(), trace_log.level
        trace_log.addHandler(handler)
        trace_log.setLevel(logging.DEBUG)
        try:
            # No cache: a cached graph keeps the kernel names (and graph id) of the compile that
            # made it, and reports no provenance.
            with config.patch(
                {
                    "cpp.enable_kernel_profile": True,
                    "trace.provenance_tracking_level": 1,
                    "fx_graph_cache": False,
                    "fx_graph_remote_cache": False,
                }
            ):
                compiled = compile_fx.compile_fx(pre_grad, example_inputs)
        finally:
            trace_log.removeHandler(handler)
            trace_log.setLevel(level)
        if payloads:
            self.graphs[graph_id] = GraphSites(
                graph_id, sites_of(json.loads(payloads[-1]), pre_grad, self.stacks)
            )
        return compiled


@dataclass
class Attribution:
    spans: list[ModuleSpan]  # synthesized module spans for the attributed calls
    attributed: int  # compiled-graph calls (kernels and extern ops) mapped to a module
    unattributed: int  # calls of a compiled graph left with the graph module
    majority: int  # of the attributed, those fused across modules (the majority rule applied)


def _graph_of(children: list[OpEvent]) -> int | None:
    for op in children:
        if match := KERNEL.match(op.name):
            return int(match.group(1))
    return None


def attribute(window: Window, graphs: dict[int, GraphSites]) -> Attribution:
    """Module spans for the kernels and extern calls of every compiled-graph call in the window:
    each call's events (the direct children of Inductor's `## Call CompiledFxGraph` op) are walked
    beside the graph's sites in order; an event matches the next site of its name."""
    spans: list[ModuleSpan] = []
    result = Attribution(spans, 0, 0, 0)
    calls = [op for op in window.ops if op.name.startswith(CALL_PREFIX)]
    children: dict[int, list[OpEvent]] = {id(call): [] for call in calls}
    for op in window.ops:
        if op.parent is not None and id(op.parent) in children:
            children[id(op.parent)].append(op)
    for call in calls:
        events = sorted(children[id(call)], key=lambda op: op.start_ns)
        graph = graphs.get(_graph_of(events))
        if graph is None:
            result.unattributed += len(events)
            continue
        cursor, attributed = 0, []
        for op in events:
            name = KERNEL.match(op.name).group(2) if KERNEL.match(op.name) else op.name
            index = next((i for i in range(cursor, len(graph.sites)) if graph.sites[i].event == name), None)
            if index is None or not graph.sites[index].stack:
                result.unattributed += 1
                continue
            cursor = index + 1
            site = graph.sites[index]
            attributed.append((op, site.stack))
            result.attributed += 1
            result.majority += site.rule == "majority"
        spans += _spans(attributed)
    return result


def _spans(calls: list[tuple[OpEvent, Stack]]) -> list[ModuleSpan]:
    """Nested spans over runs of consecutive calls that share a module prefix, as ranges.py puts
    ranges around runs of graph nodes."""
    spans: list[ModuleSpan] = []
    open_: list[ModuleSpan] = []
    for op, stack in calls:
        shared = 0
        while shared < min(len(open_), len(stack)) and open_[shared].fqn == stack[shared][0]:
            shared += 1
        del open_[shared:]
        for fqn, cls in stack[shared:]:
            span = ModuleSpan(fqn, cls, [], op.start_ns, op.end_ns, attribution="inductor_provenance")
            spans.append(span)
            open_.append(span)
        for span in open_:
            span.end_ns = max(span.end_ns, op.end_ns)
    return spans


def attribute_device(window: Window, graphs: dict[int, GraphSites]) -> tuple[int, int]:
    """On a GPU: the device kernels each compiled-graph call launched, in device order, matched by
    name and position to the sites of the graph that explains most of them (Triton kernel names
    carry no graph id). Sets each matched kernel's stack; returns (attributed, unattributed)."""
    from pipeline.profiler.cudagraphs import assign

    by_call: dict[int, list] = {}
    for event in window.device:
        op = event.op
        while op is not None and not op.name.startswith(CALL_PREFIX):
            op = op.parent
        if op is not None and event.launch != "cudaGraphLaunch":
            by_call.setdefault(id(op), []).append(event)
    sequences = [[(site.event, site.stack) for site in graph.sites] for graph in graphs.values()]
    counts = [
        assign(sorted(launched, key=lambda e: e.start_ns), sequences, "inductor_provenance")
        for launched in by_call.values()
    ]
    return sum(a for a, _ in counts), sum(u for _, u in counts)

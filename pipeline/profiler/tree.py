"""Module trees of one profiling window, and the views made from them.

Model tree: one node per module instance (by qualified name under its parent), children are the
modules it called and, as leaves, the kernels it launched (on CPU: the ATen ops it ran, each for
its self time), with the trace of ops between module and kernel. Summary tree: the model tree merged by name
path, layer indices dropped, so N decoder layers are one row with N invocations.

Times, in microseconds:
- cpu_time_us: wall time of the module's spans (for CPU kernels, the op's self time; 0 for GPU
  kernels, whose launch is not the work);
- device_time_us: kernel time on a GPU; on CPU, the self time of the ops (so nested ops are not
  counted twice). A module's device time is its own ops' and its submodules'; its kernel leaves
  break its own part down, so children never sum to more than the parent.
- span_us / busy_us / gap_us / launches: each call of a module, from the start of its first op (on
  a GPU: kernel) to the end of its last (span), the union of those ops' intervals (busy: nested and
  overlapping ones counted once) and the rest (gap = span - busy: host time between ops on CPU,
  idle device time between kernels on a GPU, which is what CUDA graphs remove); launches counts the
  ops it dispatched (outermost ones: an op's own calls are inside it) or the kernels it ran. Summed
  over calls. On a GPU the times are on the device's clock; a CUDA-graph replay's kernels count
  for the modules they were attributed to, one call per replay. A container's gap includes the
  time between its children's work; the phase's, the time between its top-level modules too.
Everything outside any module (the engine's own tensors, sampling) is kept under `(unattributed)`;
its busy time is its ops', with no span of its own (its ops are scattered over the step).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.profiler.events import Window

UNATTRIBUTED = "(unattributed)"
LAYER = re.compile(r"(^|\.)layers\.\d+$")  # a decoder (or encoder) layer of a ModuleList `layers`
INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


@dataclass
class Node:
    name: str
    kind: str  # phase | module | kernel | unattributed
    fqn: str = ""  # modules: qualified name; kernels: the module they ran in
    cls: str = ""
    params: list[tuple[str, list[int]]] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    trace: str = ""  # kernels: the ops from the module down to the kernel
    category: str = ""
    cpu_time_us: float = 0.0
    device_time_us: float = 0.0
    invocations: int = 0
    pct: float = 0.0
    children: dict[tuple, Node] = field(default_factory=dict)
    direct_us: float = 0.0  # device time of this module's own ops (its kernel leaves break it down)
    attribution: str = ""  # modules: how their time was found (events.ModuleSpan.attribution)
    span_us: float = 0.0
    busy_us: float = 0.0
    launches: float = 0.0  # a float while windows are averaged (mean_tree rounds it)

    @property
    def gap_us(self) -> float:
        return self.span_us - self.busy_us

    def child(self, key: tuple, make: Callable[[], Node]) -> Node:
        if key not in self.children:
            self.children[key] = make()
        return self.children[key]

    def walk(self):
        yield self
        for c in self.children.values():
            yield from c.walk()


def _kernel_leaf(owner: Node, name: str, shapes: list[list[int]], trace: list[str], category: str) -> Node:
    key = ("kernel", name, " > ".join(trace), repr(shapes))
    return owner.child(
        key, lambda: Node(name, "kernel", fqn=owner.fqn, shapes=shapes, trace=key[2], category=category)
    )


def _under(owner: Node, stack: tuple[tuple[str, str], ...], attribution: str) -> list[Node]:
    """The module nodes, outermost first, of a kernel whose module is known by its stack, below the
    span open at its launch (the CUDA-graph runner, a graph module): entries that are that span or
    above it are skipped, the rest nested under it."""
    node, chain = owner, []
    for fqn, cls in stack:
        if owner.fqn == fqn or owner.fqn.startswith(fqn + "."):
            continue
        node = node.child(
            ("module", fqn),
            lambda fqn=fqn, cls=cls: Node(_short(fqn) or cls, "module", fqn, cls, attribution=attribution),
        )
        node.invocations = max(node.invocations, 1)
        chain.append(node)
    return chain


@dataclass
class _Call:
    """One call of a module (or the whole step): the intervals of the work it ran, in ns."""

    node: Node
    start_ns: int  # the call's own start: an op whose caller started before it was dispatched here
    intervals: list[tuple[int, int]] = field(default_factory=list)
    launches: int = 0

    def add(self, start_ns: int, end_ns: int, launched: bool) -> None:
        self.intervals.append((start_ns, end_ns))
        self.launches += launched

    def close(self) -> None:
        """Adds this call's span, busy time and launches to its node."""
        if not self.intervals:
            return
        self.intervals.sort()
        busy, (run_start, run_end) = 0, self.intervals[0]
        for start, end in self.intervals[1:]:
            if start > run_end:
                busy, run_start = busy + run_end - run_start, start
            run_end = max(run_end, end)
        busy += run_end - run_start
        span = max(end for _, end in self.intervals) - self.intervals[0][0]
        self.node.busy_us += busy / 1000
        self.node.span_us += (span if self.node.kind != "unattributed" else busy) / 1000
        self.node.launches += self.launches


def _total(node: Node) -> float:
    """Device time bottom-up: own ops plus submodules (kernel leaves are part of the own ops)."""
    if node.kind == "kernel":
        return node.device_time_us
    node.device_time_us = node.direct_us + sum(
        _total(c) for c in node.children.values() if c.kind != "kernel"
    )
    return node.device_time_us


def _percent(root: Node) -> None:
    for node in root.walk():
        node.pct = 100 * node.device_time_us / root.device_time_us if root.device_time_us else 0.0


def model_tree(window: Window, phase: str, categorize: Callable[[str], str]) -> Node:
    root = Node(phase, "phase", invocations=1, cpu_time_us=window.span_ns / 1000)
    unattributed = Node(UNATTRIBUTED, "unattributed")
    # One sweep in time order; an event belongs to the innermost module span open at its start.
    items = [(s.start_ns, 0, i) for i, s in enumerate(window.modules)]
    items += [(o.start_ns, 1, i) for i, o in enumerate(window.ops)]
    items += [(d.anchor_ns, 2, i) for i, d in enumerate(window.device)]
    items.sort(key=lambda t: (t[0], t[1], -window.modules[t[2]].end_ns if t[1] == 0 else 0))
    stack: list[tuple[int, Node, _Call]] = []  # (end_ns, node, call) of the open spans
    step, outside = _Call(root, 0), _Call(unattributed, 0)
    calls = [step, outside]
    replayed: dict[tuple[int, int], _Call] = {}  # (module node, replay) -> that call
    for time_ns, kind, index in items:
        while stack and stack[-1][0] <= time_ns:
            stack.pop()
        owner = stack[-1][1] if stack else None
        if kind == 0:
            span = window.modules[index]
            parent = owner or root
            node = parent.child(
                ("module", span.fqn),
                lambda span=span: Node(
                    _short(span.fqn) or span.cls,
                    "module",
                    span.fqn,
                    span.cls,
                    span.params,
                    attribution=span.attribution,
                ),
            )
            node.cpu_time_us += (span.end_ns - span.start_ns) / 1000
            node.invocations += 1
            calls.append(_Call(node, span.start_ns))
            stack.append((span.end_ns, node, calls[-1]))
            continue
        target = owner or unattributed
        open_calls = [step] + [call for _, _, call in stack] if stack else [step, outside]
        if kind == 1:
            op = window.ops[index]
            if target is unattributed and op.parent is None:
                unattributed.cpu_time_us += (op.end_ns - op.start_ns) / 1000
            if window.on_device:
                continue  # on a GPU, device time is kernel time
            for call in open_calls:
                call.add(op.start_ns, op.end_ns, op.parent is None or op.parent.start_ns < call.start_ns)
            # On CPU an op's self time is its kernel: every op is a leaf for the time it spends
            # outside the ops it calls (aten::mm's GEMM, not aten::linear's dispatch).
            self_us = op.self_ns / 1000
            target.direct_us += self_us
            leaf = _kernel_leaf(target, op.name, op.shapes, op.trace(), categorize(op.name))
            leaf.device_time_us += self_us
            leaf.cpu_time_us += self_us
            leaf.invocations += 1
        else:
            event = window.device[index]
            trace = event.op.trace() if event.op else []
            shapes = event.op.shapes if event.op else []
            replay = []
            if event.stack and (chain := _under(target, event.stack, event.attribution)):
                target = chain[-1]
                replay = [
                    replayed.setdefault((id(node), event.correlation), _Call(node, event.anchor_ns))
                    for node in chain
                ]
            for call in open_calls + replay:
                call.add(event.start_ns, event.start_ns + event.duration_ns, True)
            leaf = _kernel_leaf(target, event.name, shapes, trace, categorize(event.name))
            leaf.device_time_us += event.duration_ns / 1000
            leaf.invocations += 1
            target.direct_us += event.duration_ns / 1000
    for call in calls + list(replayed.values()):
        call.close()
    if unattributed.direct_us or unattributed.children or unattributed.cpu_time_us:
        unattributed.invocations = 1
        root.children[("unattributed",)] = unattributed
    _total(root)
    _percent(root)
    return root


def summary_name(fqn: str) -> str:
    """Layer indices dropped: `lm.layers.3.mlp` -> `lm.layers.*.mlp`."""
    return INDEX.sub("*", fqn)


def _short(fqn: str) -> str:
    """The last name of a path, with its list name when it is an index: `layers.*`, `layers.3`."""
    parts = fqn.split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 and (parts[-1] == "*" or parts[-1].isdigit()) else parts[-1]


def _merge_into(
    target: Node, node: Node, key_of: Callable[[Node], tuple], fqn_of: Callable[[str], str], scale: float
) -> None:
    target.cpu_time_us += node.cpu_time_us * scale
    target.device_time_us += node.device_time_us * scale
    target.direct_us += node.direct_us * scale
    target.span_us += node.span_us * scale
    target.busy_us += node.busy_us * scale
    target.launches += node.launches * scale
    target.invocations += node.invocations
    for c in node.children.values():
        key = key_of(c)
        merged = target.child(
            key,
            lambda c=c: Node(
                c.name,
                c.kind,
                fqn_of(c.fqn),
                c.cls,
                c.params,
                c.shapes,
                c.trace,
                c.category,
                attribution=c.attribution,
            ),  # fmt: skip
        )
        _merge_into(merged, c, key_of, fqn_of, scale)


def _instance_key(node: Node) -> tuple:
    # Not by shapes: a decode step's attention reads one more cached token each step.
    return (node.kind, node.fqn, node.name, node.trace)


def _summary_key(node: Node) -> tuple:
    if node.kind == "kernel":
        return ("kernel", node.name, node.trace)
    return (node.kind, summary_name(node.fqn))


def summary_tree(model: Node) -> Node:
    root = Node(model.name, "phase")
    _merge_into(root, model, _summary_key, summary_name, 1.0)
    for node in root.walk():
        if node.kind == "module":
            node.name = _short(node.fqn) or node.cls
    _percent(root)
    return root


def mean_tree(trees: list[Node], phase: str) -> Node:
    """The mean of several windows of the same step kind (decode_1..N): times and invocations per
    window."""
    root = Node(phase, "phase")
    for tree in trees:
        _merge_into(root, tree, _instance_key, str, 1 / len(trees))
    for node in root.walk():
        node.invocations = round(node.invocations / len(trees))
        node.launches = round(node.launches)
    _percent(root)
    return root


RUNTIME = "runtime"  # the kernel category of torch.compile's own work around a compiled call


def coverage(root: Node) -> tuple[float, float]:
    """(percent of device time inside any module, percent of the layer stacks' device time inside
    a layer or deeper). A layer stack is the module that holds `layers.N`; its time here leaves out
    what torch.compile's runtime spends around each compiled call (guards, wrappers: category
    `runtime`), which is host work of no layer, shown as its own leaves: one call per graph, or one
    per segment with piecewise capture."""
    total = root.device_time_us
    outside = sum(c.device_time_us for c in root.children.values() if c.kind == "unattributed")
    attributed = 100 * (total - outside) / total if total else 0.0
    layers = [n for n in root.walk() if n.kind == "module" and LAYER.search(n.fqn)]
    stack_names = {LAYER.sub("", n.fqn) for n in layers}
    stacks = [n for n in root.walk() if n.kind == "module" and n.fqn in stack_names]
    stack_time = sum(n.device_time_us - _runtime_us(n) for n in stacks)
    in_layers = sum(n.device_time_us - _runtime_us(n) for n in layers)
    return attributed, (100 * in_layers / stack_time if stack_time else 0.0)


def _runtime_us(node: Node) -> float:
    return sum(n.device_time_us for n in node.walk() if n.kind == "kernel" and n.category == RUNTIME)


ATTRIBUTIONS = ("module_range", "inductor_provenance", "cudagraph_sequence", "unattributed")


def attribution_pct(root: Node) -> dict[str, float]:
    """Percent of the phase's device time by how it was attributed: the kernel leaves of modules
    found each way, and `unattributed` (outside every module)."""
    total = root.device_time_us
    shares = dict.fromkeys(ATTRIBUTIONS, 0.0)
    for node in root.walk():
        if node.kind == "unattributed":
            shares["unattributed"] += node.device_time_us
        elif node.kind == "module":
            shares[node.attribution or "module_range"] += node.direct_us
    return {k: 100 * v / total if total else 0.0 for k, v in shares.items()}

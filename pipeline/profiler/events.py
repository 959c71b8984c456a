"""One profiling window read into plain records: module spans, ops and device events.

This is the only module that touches the profiler's private event tree
(`kineto_results.experimental_event_tree()`, `_EventType`), so a torch upgrade changes one file.

- Module spans come from two sources: `nn.Module: <Class>_<n>` python events (eager modules,
  recorded with `with_stack=True`; `self_ptr` is the module's id, joined with `named_modules()`
  for its qualified name), and `module::<fqn>|<Class>` ranges that ranges.py puts into exported
  graphs and around eager modules. Ranges start inside a python frame, so the tree does not nest ops
  under them: attribution is by time containment on the profiled thread, not by tree parents. An
  eager module has both (its call event, and inside it the range its hooks put in for outside
  readers): the range is dropped, one span per module call.
- Ops are TorchOp events (ATen and torch.library ops); self time excludes child ops.
- Device events (CUDA kernels, copies) are kineto events on the GPU. Each is tied to the CPU event
  that launched it by correlation id (a CUDA-graph replay's kernels all share the id of its
  cudaGraphLaunch), and placed at that CPU event's start time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch._C._autograd import DeviceType
from torch._C._profiler import _EventType

from pipeline.graphs import parse_range


@dataclass
class ModuleSpan:
    fqn: str
    cls: str
    params: list[tuple[str, list[int]]]
    start_ns: int
    end_ns: int
    # How the span was found: module_range (an eager module's event or a module:: range recorded
    # as it ran), inductor_provenance (compiled kernels mapped to nodes), cudagraph_sequence
    # (replayed kernels matched to the sequence recorded for the graph)
    attribution: str = "module_range"


@dataclass
class OpEvent:
    name: str
    start_ns: int
    end_ns: int
    shapes: list[list[int]]
    parent: OpEvent | None = None  # the op that called this one
    child_ns: int = 0  # time in child ops

    @property
    def self_ns(self) -> int:
        return max(self.end_ns - self.start_ns - self.child_ns, 0)

    def trace(self) -> list[str]:
        """Op names from the outermost op down to this one."""
        chain, op = [], self
        while op is not None:
            chain.append(op.name)
            op = op.parent
        return chain[::-1]


@dataclass
class DeviceEvent:
    name: str
    duration_ns: int
    anchor_ns: int  # CPU time of the launch: where it sits in the module spans
    op: OpEvent | None  # the op that launched it, when it ran inside one
    start_ns: int = 0  # on the device's clock: orders a replay's kernels
    correlation: int = -1  # the launch's correlation id (one for all kernels of a graph replay)
    launch: str = ""  # the runtime call that launched it: cudaLaunchKernel, cudaGraphLaunch, ...
    # Set when the kernel's module is known other than by time (a CUDA-graph replay's kernels all
    # sit at their launch's instant): ((fqn, class), ...) outermost first, and how it was found
    stack: tuple[tuple[str, str], ...] | None = None
    attribution: str = ""


@dataclass
class Window:
    modules: list[ModuleSpan] = field(default_factory=list)
    ops: list[OpEvent] = field(default_factory=list)
    device: list[DeviceEvent] = field(default_factory=list)
    on_device: bool = False  # device events were recorded: device time is kernel time

    @property
    def span_ns(self) -> int:
        starts = [o.start_ns for o in self.ops] + [m.start_ns for m in self.modules]
        ends = [o.end_ns for o in self.ops] + [m.end_ns for m in self.modules]
        return max(ends) - min(starts) if starts else 0


def _shapes(event) -> list[list[int]]:
    shapes = []
    for value in getattr(event.extra_fields, "inputs", []) or []:
        sizes = getattr(value, "sizes", None)
        if sizes is not None:
            shapes.append([int(s) for s in sizes])
    return shapes


def _module_span(event, module_names: dict[int, str]) -> ModuleSpan | None:
    if event.tag == _EventType.PyCall:
        module = event.extra_fields.module
        # A module outside the model's tree (a library's function wrapped as an nn.Module, e.g.
        # transformers' hub-kernel `Func` around rotary embedding) is not a part of the model: its
        # ops stay with the model's module that called it.
        if module is None or module.self_ptr not in module_names:
            return None
        params = [(name, [int(s) for s in meta.sizes]) for name, meta, _ in module.parameters or []]
        return ModuleSpan(
            module_names[module.self_ptr], module.cls_name, params, event.start_time_ns, event.end_time_ns
        )
    if event.tag == _EventType.TorchOp and (parsed := parse_range(event.name)):
        return ModuleSpan(parsed[0], parsed[1], [], event.start_time_ns, event.end_time_ns)
    return None


def _is_op(event) -> bool:
    if event.tag != _EventType.TorchOp or parse_range(event.name):
        return False
    return not event.name.startswith("ProfilerStep#")  # the schedule's own step marker


def _device_events(prof) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """(correlation id, name) -> (duration, start) of device events; all events of a graph replay
    share their launch's correlation id."""
    found: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for event in prof.profiler.kineto_results.events():
        if event.device_type() == DeviceType.CUDA:
            found.setdefault((event.correlation_id(), event.name()), []).append(
                (event.duration_ns(), event.start_ns())
            )
    return found


def read_window(prof, module_names: dict[int, str]) -> Window:
    """The window's events on the thread that ran the model (the one with the most ops)."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    per_thread: dict[int, list] = {}
    for root in roots:
        per_thread.setdefault(root.start_tid, []).append(root)
    if not per_thread:
        return Window()

    def count_ops(events) -> int:
        stack, n = list(events), 0
        while stack:
            e = stack.pop()
            n += e.tag == _EventType.TorchOp
            stack.extend(e.children)
        return n

    thread_roots = max(per_thread.values(), key=count_ops)
    device = _device_events(prof)
    window = Window(on_device=bool(device))
    claimed: set[tuple[int, str]] = set()
    launches: dict[int, tuple[int, OpEvent | None, str]] = {}  # correlation id -> (CPU time, op, call)

    def walk(event, op: OpEvent | None, anchor_ns: int, called: str | None = None) -> None:
        if span := _module_span(event, module_names):
            if event.tag == _EventType.PyCall:
                called = span.fqn
                window.modules.append(span)
            elif span.fqn != called:  # not the range an eager module's hooks put inside its call
                window.modules.append(span)
        if _is_op(event):
            new = OpEvent(event.name, event.start_time_ns, event.end_time_ns, _shapes(event), parent=op)
            if op is not None:
                op.child_ns += new.end_ns - new.start_ns
            window.ops.append(new)
            op = new
        key = (event.correlation_id, event.name)
        if event.tag == _EventType.Kineto and key in device:
            # A device event placed in the tree under its launch: it sits at the launch's CPU time.
            if key not in claimed:
                claimed.add(key)
                launch = launches.get(event.correlation_id, (0, None, ""))[2]
                window.device += [
                    DeviceEvent(event.name, d, anchor_ns, op, t, event.correlation_id, launch)
                    for d, t in device[key]
                ]
            return
        if event.tag != _EventType.Kineto or event.name.startswith("cuda"):
            anchor_ns = event.start_time_ns  # a CPU-side event: python frame, op or runtime call
        if event.tag == _EventType.Kineto:
            launches.setdefault(event.correlation_id, (anchor_ns, op, event.name))
        for child in event.children:
            walk(child, op, anchor_ns, called)

    for root in thread_roots:
        walk(root, None, root.start_time_ns)
    # Device events the tree did not place: tie them to their launch by correlation id.
    for (correlation, name), timings in device.items():
        if (correlation, name) in claimed:
            continue
        anchor_ns, op, launch = launches.get(correlation, (-1, None, ""))
        window.device += [DeviceEvent(name, d, anchor_ns, op, t, correlation, launch) for d, t in timings]
    return window

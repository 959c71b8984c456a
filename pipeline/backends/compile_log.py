"""What Dynamo and Inductor did for each frame they compiled: the graph it belongs to, its guards,
its ops, the Inductor kernels generated for it, the graph break that split it and, for a
recompile, the guard that failed (torch's own words).

Dynamo's per-frame records (`torch._dynamo.utils.get_compilation_metrics`: a deque of the last 64)
are read at every compile's end callback, so none is lost to the deque's length; Inductor's kernel
count is process-wide, so each frame's share is read between its start and end callbacks. The graph
a frame belongs to is the one whose call is running when it compiles (`CompileLog.graph`, set by
backends/compile.py around each compiled graph's call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FrameCompile:
    compile_id: str  # Dynamo's `<frame>/<recompile>`: 0/1 is frame 0's first recompile
    graph: str  # the compiled graph's path (or segment), else the frame's code name
    guards: int
    graph_ops: int
    kernels: int  # Inductor kernels generated for it
    graph_break: str  # why Dynamo split the frame here (its first restart reason), or ""
    recompile_reason: str  # why the frame's code compiled before did not apply, or "" (a first compile)


@dataclass
class CompileLog:
    """The frames compiled in this process since `install`, in order."""

    frames: list[FrameCompile] = field(default_factory=list)
    graph: str = ""  # the graph whose call is running
    _read: set[tuple[str, int]] = field(default_factory=set)  # (compile id, start us) of records read
    _kernels_at_start: dict[str, tuple[int, str]] = field(default_factory=dict)
    _kernels: dict[str, tuple[int, str]] = field(default_factory=dict)  # compile id -> (kernels, graph)

    def install(self) -> None:
        """The callbacks on Dynamo's handler, again after a `torch._dynamo.reset()` cleared them."""
        from torch._dynamo.callback import callback_handler

        if self._start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
            # the records of frames compiled before are no frames of ours (their ids repeat ours)
            self._read |= {_key(r) for r in torch._dynamo.utils.get_compilation_metrics()}

    def _start(self, args) -> None:
        from torch._inductor import metrics

        self._kernels_at_start[args.compile_id] = (metrics.generated_kernel_count, self.graph)

    def _end(self, args) -> None:
        from torch._inductor import metrics

        start, graph = self._kernels_at_start.pop(args.compile_id, (metrics.generated_kernel_count, ""))
        self._kernels[args.compile_id] = (metrics.generated_kernel_count - start, graph)
        self._collect()

    def _collect(self) -> None:
        """Dynamo's records of the frames whose end was seen, once each, in compile order (a frame's
        record is written after its end callback, so each is read at a later one or at `since`)."""
        for record in torch._dynamo.utils.get_compilation_metrics():
            # compile ids start again at 0/0 after a reset: a record is its id and its start
            key = _key(record)
            if key in self._read or record.compile_id not in self._kernels:
                continue
            self._read.add(key)
            kernels, graph = self._kernels.pop(record.compile_id)
            restarts = sorted(record.restart_reasons or ())
            self.frames.append(
                FrameCompile(
                    record.compile_id,
                    graph or record.co_name or "",
                    record.guard_count or 0,
                    record.graph_op_count or 0,
                    kernels,
                    _reason(restarts[0]) if restarts else "",
                    record.recompile_reason or "",
                )
            )

    def mark(self) -> int:
        self.install()
        self._collect()
        return len(self.frames)

    def since(self, mark: int) -> list[FrameCompile]:
        """The frames compiled after `mark` (a `mark()` taken earlier)."""
        self._collect()
        return self.frames[mark:]


def _key(record) -> tuple[str, int]:
    return record.compile_id, record.start_time_us or 0


def _reason(restart: str) -> str:
    """A restart reason's first line and its explanation: `Failed to trace builtin operator: Dynamo
    does not know how to trace builtin operator `print` ...`."""
    lines = [line.strip() for line in restart.splitlines() if line.strip()]
    explained = next(
        (line.removeprefix("Explanation: ") for line in lines[1:] if line.startswith("Explanation:")), ""
    )
    return f"{lines[0]}: {explained}" if explained else (lines[0] if lines else "")


LOG = CompileLog()


def facts(frames: list[FrameCompile]) -> dict[str, float]:
    """capture/* metrics of a set of compiled frames: how many broke the graph, the guards and the
    Inductor kernels over them."""
    return {
        "graph_breaks": sum(bool(f.graph_break) for f in frames),
        "guards": sum(f.guards for f in frames),
        "inductor_kernels": sum(f.kernels for f in frames),
    }


def columns(frames: list[FrameCompile]) -> dict[str, list]:
    """The frames as an MLflow table: a column per field."""
    names = list(FrameCompile.__dataclass_fields__)
    return {name: [getattr(f, name) for f in frames] for name in names}

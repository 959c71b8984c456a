"""Which modules a CUDA-graph replay's kernels belong to.

A replay's kernels all carry the correlation id of their `cudaGraphLaunch` and sit at its instant,
so neither module ranges nor launch times can tell them apart. What does is the order: a graph
replays the kernels it captured, in capture order. So, per captured bucket, the kernels of one run
of the same step outside the graph are recorded with their modules (`record`: module ranges in
the graph under torch-cudagraph, Inductor provenance under torch-opt), and a replay's kernels,
in time order, are matched to that sequence by position and name (`align`): a kernel the replay
has and the sequence does not (or the reverse) is skipped over, and a replayed kernel that matches
nothing stays with the runner, counted as unattributed, never dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.profiler.events import DeviceEvent, Window

Stack = tuple[tuple[str, str], ...]
LOOKAHEAD = 8  # how far ahead a name is looked for when the replay and the record disagree


def align(replayed: Sequence[str], recorded: Sequence[tuple[str, Stack]]) -> list[Stack | None]:
    """Each replayed kernel's stack from the recorded sequence, None where none matches. Equal
    names advance both; on a mismatch, a recorded kernel the replay skipped is passed over when
    the replayed name comes within LOOKAHEAD entries, else the replayed kernel is extra."""
    stacks: list[Stack | None] = []
    cursor = 0
    for name in replayed:
        ahead = next(
            (i for i in range(cursor, min(cursor + LOOKAHEAD, len(recorded))) if recorded[i][0] == name), None
        )
        if ahead is None:
            stacks.append(None)  # an extra kernel: the record has none of its name here
            continue
        stacks.append(recorded[ahead][1])
        cursor = ahead + 1
    return stacks


def replays(window: Window) -> list[list[DeviceEvent]]:
    """The window's device events grouped by replay: those of one cudaGraphLaunch, in time order."""
    groups: dict[int, list[DeviceEvent]] = {}
    for event in window.device:
        if event.launch == "cudaGraphLaunch":
            groups.setdefault(event.correlation, []).append(event)
    return [sorted(group, key=lambda e: e.start_ns) for group in groups.values()]


def assign(
    launched: list[DeviceEvent], sequences: list[list[tuple[str, Stack]]], attribution: str
) -> tuple[int, int]:
    """Set the stack of each kernel of one launch group (in device order) from the sequence that
    explains most of them; returns (attributed, unattributed)."""
    names = [event.name for event in launched]
    best = max(
        (align(names, sequence) for sequence in sequences),
        key=lambda stacks: sum(bool(s) for s in stacks),
        default=[None] * len(names),
    )
    attributed = 0
    for event, stack in zip(launched, best, strict=True):
        if stack:
            event.stack, event.attribution = stack, attribution
            attributed += 1
    return attributed, len(launched) - attributed


def attribute(window: Window, sequences: list[list[tuple[str, Stack]]]) -> tuple[int, int]:
    """Set the stack of every replayed kernel the best-matching recorded sequence explains;
    returns (attributed, unattributed) kernel counts."""
    counts = [assign(replay, sequences, "cudagraph_sequence") for replay in replays(window)]
    return sum(a for a, _ in counts), sum(u for _, u in counts)


def recorded(window: Window) -> list[tuple[str, Stack]]:
    """A recording run's kernels in device order, each with its module stack: the one provenance
    set, else the module spans open at its launch (outermost first)."""
    sequence = []
    for event in sorted(window.device, key=lambda e: e.start_ns):
        stack = event.stack
        if stack is None:
            open_ = [s for s in window.modules if s.start_ns <= event.anchor_ns < s.end_ns]
            open_.sort(key=lambda s: (s.start_ns, -s.end_ns))
            stack = tuple((s.fqn, s.cls) for s in open_)
        sequence.append((event.name, stack))
    return sequence

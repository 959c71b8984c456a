"""The captured run against the eager reference, part by part (module slices), with a speedup
only where both sides did the same work; every other row says why not."""

from __future__ import annotations

import re

from pipeline.profiler.parts import LAYER_INDEX, MEASURABLE_US, SliceTimes, part_of, slice_of
from pipeline.profiler.rows import ComparedPart, Phases, PhaseStats
from pipeline.profiler.tree import UNATTRIBUTED


def _rewritten_by(part: str, rewritten: dict[str, str]) -> str:
    """The model-scope transforms that rewrote a module of `part` (or the part itself), or ''. A
    container's own time (`<fqn> (self)`) is rewritten only where the container itself was."""
    own = part.endswith(" (self)")
    name = part.removesuffix(" (self)")
    for path, transforms in rewritten.items():
        path = LAYER_INDEX.sub(".layers.*.", path + ".").rstrip(".")
        inside = path.startswith(name + ".") or name.startswith(path + ".")
        if path == name or (inside and not own):
            return transforms
    return ""


def _fusion_edges(fused: dict[str, set[str]], names: set[str]) -> dict[str, set[str]]:
    """provenance.fused_modules at slice level: slice -> the other slices whose kernels compute
    some of its work."""
    edges: dict[str, set[str]] = {}
    for source, targets in fused.items():
        a = slice_of(source, names)
        for b in (slice_of(t, names) for t in targets):
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)
    return edges


def _groups(edges: dict[str, set[str]]) -> dict[str, tuple[str, ...]]:
    """Slice -> the slices joined with it by fusion, transitively (itself included)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            name = parent[name]
        return name

    for a, targets in edges.items():
        for b in targets:
            parent[root(a)] = root(b)
    members: dict[str, list[str]] = {}
    for name in list(parent):
        members.setdefault(root(name), []).append(name)
    return {name: tuple(sorted(group)) for group in members.values() for name in group}


def _short(name: str) -> str:
    """A slice as the note names it: from the decoder layer down (`layers.*.self_attn`)."""
    match = re.search(r"(^|\.)(layers\.\*\..*)$", name)
    return match.group(2) if match else name


def comparison(
    captured: Phases,
    eager: Phases,
    phases=("prefill", "decode"),
    rewritten: dict[str, str] | None = None,
    fused: dict[str, set[str]] | None = None,
    graphs: tuple[str, ...] = (),
    moved: dict[str, dict[str, str]] | None = None,
) -> dict[str, list[ComparedPart]]:
    """Per phase, per module part (module_slices): device ms per step of the captured run and of the
    eager reference on the same workload, and the speedup (eager / captured), largest parts first;
    a `total` row last. A speedup is printed only where both sides did the same work; otherwise the
    row says why (`note`):
    - parts whose work Inductor fused together (`fused`: provenance.fused_modules), or a graph
      transform moved from one part's nodes into another's (`moved`: registry.moved_work, source ->
      {target: transforms}, named in the note), have none each; one `fused:` row sums the group on
      both sides and carries the group's speedup;
    - a part a model-scope rewrite changed (`rewritten`: path -> transforms,
      registry.rewritten_modules) has none: its gain is that transform's, not capture's;
    - a captured graph's own time (`<graph> (self)`: torch.compile's call and guards, against
      HF's masks and cache bookkeeping), a part measurable on one side only, and unattributed
      time have none;
    - demollm's spans (`demollm.*`) are each runner's own bookkeeping (the paged runner's against
      the eager runner's): none;
    - the prefill's lm_head inside a whole-model graph (`graphs` holds "") computes every prompt
      row where eager computes the last: none."""
    out: dict[str, list] = {}
    for phase in phases:
        if phase not in captured or phase not in eager:
            continue
        ours_times, theirs_times = (
            SliceTimes.of(captured[phase].summary_stats),
            SliceTimes.of(eager[phase].summary_stats),
        )
        ours, theirs = ours_times.device, theirs_times.device
        # every slice with time or gaps on either side: a container's gaps between its children
        # are a row even where it does no work of its own
        names = sorted(
            set().union(*(times for side in (ours_times, theirs_times) for times in vars(side).values())),
            key=lambda n: -(ours.get(n, 0.0) + theirs.get(n, 0.0)),
        )
        edges = _fusion_edges(fused or {}, set(names))
        by: dict[tuple[str, str], str] = {}  # slice edge -> the graph transforms that made it
        for source, targets in (moved or {}).items():
            for target, transforms in targets.items():
                a, b = slice_of(source, set(names)), slice_of(target, set(names))
                if a and b and a != b:
                    edges.setdefault(a, set()).add(b)
                    by[(a, b)] = transforms
        groups = _groups(edges)

        def named(a: str, b: str, shown: str, by: dict[tuple[str, str], str] = by) -> str:
            return f"{_short(shown)} by {by[(a, b)]}" if (a, b) in by else _short(shown)

        into: dict[str, set[str]] = {}
        for a, targets in edges.items():
            for b in targets:
                into.setdefault(b, set()).add(a)
        rows: list[ComparedPart] = []
        grouped: dict[tuple[str, ...], list[str]] = {}
        for name in names:
            row = compared_part(name, *_sides(ours_times.of_slices([name]), theirs_times.of_slices([name])))
            if transforms := _rewritten_by(name, rewritten or {}):
                _unmeasured(row, f"rewritten by {transforms}")
            elif name in groups:
                said = (
                    [f"fused into {', '.join(sorted(named(name, b, b) for b in edges[name]))}"]
                    if name in edges
                    else []
                )
                said += (
                    [f"holds fused {', '.join(sorted(named(a, name, a) for a in into[name]))}"]
                    if name in into
                    else []
                )
                _unmeasured(row, "; ".join(said) + " (ratio: the fused row)")
                grouped.setdefault(groups[name], []).append(name)
            elif name.startswith(UNATTRIBUTED):
                _unmeasured(row, "no module: not comparable")
            elif name.removesuffix(" (self)") in graphs and name.endswith(" (self)"):
                _unmeasured(row, "the graph's own ops: not the same work on both sides")
            elif name.startswith("demollm."):
                _unmeasured(row, "each runner's own bookkeeping: not the same work")
            elif phase == "prefill" and part_of(name) == "lm_head" and "" in graphs:
                _unmeasured(
                    row,
                    "the graph computes the lm_head on every prompt row, eager on the last: not the same work",
                )
            rows.append(row)
        for members in grouped.values():
            largest = _short(max(members, key=lambda n: theirs.get(n, 0.0)))
            group = compared_part(
                f"fused: {largest} + {len(members) - 1} more",
                *_sides(ours_times.of_slices(members), theirs_times.of_slices(members)),
            )
            group.note = (
                "the parts fused together (Inductor's kernels, a transform's nodes), summed on both sides"
            )
            rows.append(group)
        rows.sort(key=lambda r: -(r.captured_ms + r.eager_ms + r.captured_gap_ms + r.eager_gap_ms))
        rows.append(compared_part("total", *_sides(step_times(captured[phase]), step_times(eager[phase]))))
        out[phase] = rows
    return out


def step_times(phase: PhaseStats | None) -> tuple[float, float, float]:
    """(device, busy, gap) us of the whole step; zeros for no phase."""
    if phase is None:
        return 0.0, 0.0, 0.0
    root = phase.model_stats
    return phase.device_time_us, root.busy_us, root.gap_us


def _sides(captured: tuple[float, float, float], eager: tuple[float, float, float]) -> tuple:
    """compared_part's arguments from each side's (device, busy, gap) us."""
    return captured[0], eager[0], captured[1:], eager[1:]


def compared_part(
    part: str,
    captured_us: float,
    eager_us: float,
    captured_split: tuple[float, float] = (0.0, 0.0),
    eager_split: tuple[float, float] = (0.0, 0.0),
) -> ComparedPart:
    """One row from each side's device time and its (busy, gap) split, in us."""
    measured = captured_us >= MEASURABLE_US and eager_us >= MEASURABLE_US
    note = ""
    if captured_us < MEASURABLE_US <= eager_us:
        note = "no time on the captured side: its work is in another part"
    elif eager_us < MEASURABLE_US <= captured_us:
        note = "captured side only"
    return ComparedPart(
        part, captured_us / 1000, eager_us / 1000, eager_us / captured_us if measured else None, note,
        *(us / 1000 for us in (*captured_split, *eager_split)),
    )  # fmt: skip


def _unmeasured(row: ComparedPart, why: str) -> None:
    row.speedup, row.note = None, why

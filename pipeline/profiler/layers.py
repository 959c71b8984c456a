"""The per-layer table: one row per part a forward runs (the vision tower, the projector, each
decoder layer, the lm_head: numerics.part_paths) and the rest of the step, joining what the run
measured about it: device ms on the captured run and the eager reference, the ratio or why not
(as the comparison decides), each side's busy time and gaps (tree.py), the share of its roof, and
its numerics against eager (the check calls' for prefill, a decode step's for decode), the first
part past tolerance marked.

Decoder layers of different kinds (sliding-window and global attention, dense and
mixture-of-experts, cross-attention layers) are grouped by kind, with a row summing each kind;
layers alike have no kind, and the comparison's rows summed over layers say the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from pipeline.profiler.comparison import compared_part, step_times
from pipeline.profiler.parts import MEASURABLE_US
from pipeline.profiler.rows import LayerRow, Phases, PhaseStats, ProfileNode, RoofRow
from pipeline.profiler.tree import summary_name

LAYER = re.compile(r"^(.*\.)?layers\.\d+$")
REST = "rest of the step"


def layer_kinds(model: nn.Module, parts: list[str], layer_types: list[str] | None) -> dict[str, str]:
    """Decoder layer path -> its kind, where a stack's layers differ: the text config's
    `layer_types` entry, the layer's class, or its children's classes (`mlp=MixtralSparseMoeBlock`),
    whichever differ; {} when every layer is alike."""
    layers = [p for p in parts if LAYER.match(p)]
    signatures = {}
    for path in layers:
        module = model.get_submodule(path)
        index = int(path.rsplit(".", 1)[1])
        kind = layer_types[index] if layer_types and index < len(layer_types) else ""
        children = tuple((name, type(child).__name__) for name, child in module.named_children())
        signatures[path] = (kind, type(module).__name__, children)
    if len(set(signatures.values())) < 2:
        return {}
    differ = [len({s[i] for s in signatures.values()}) > 1 for i in range(3)]
    kinds = {}
    for path, (kind, cls, children) in signatures.items():
        said = [kind] if differ[0] else []
        said += [cls] if differ[1] else []
        if differ[2]:
            common = set.intersection(*(set(s[2]) for s in signatures.values()))
            said += [f"{name}={child}" for name, child in children if (name, child) not in common]
        kinds[path] = " ".join(said)
    return kinds


def _modules(phase: PhaseStats | None) -> dict[str, ProfileNode]:
    """A phase's model-tree modules by qualified name ({} for no phase), built once per table."""
    return {n.fqn: n for n in phase.model_stats.walk() if n.kind == "module"} if phase is not None else {}


def _times(modules: dict[str, ProfileNode], fqn: str) -> tuple[float, float, float]:
    """(device, busy, gap) us of one module instance (_modules), 0 where absent."""
    node = modules.get(fqn)
    return (node.device_time_us, node.busy_us, node.gap_us) if node is not None else (0.0, 0.0, 0.0)


def _part_of(fqn: str, parts: list[str]) -> str | None:
    return next((p for p in parts if fqn == p or fqn.startswith(p + ".")), None)


@dataclass
class Unlike:
    """Where the two sides did not do the same work part by part."""

    rewritten: dict[str, str]  # module path -> the model-scope transforms that rewrote it
    shared: dict[str, set[str]]  # part -> the other parts its work was fused or moved into or from

    @classmethod
    def of(
        cls,
        parts: list[str],
        rewritten: dict[str, str],
        fused: dict[str, set[str]],
        moved: dict[str, dict[str, str]],
    ) -> Unlike:
        shared: dict[str, set[str]] = {}
        edges = [(a, b) for a, targets in fused.items() for b in targets]
        edges += [(a, b) for a, targets in moved.items() for b in targets]
        for a, b in edges:
            part_a, part_b = _part_of(a, parts), _part_of(b, parts)
            if part_a and part_b and part_a != part_b:
                shared.setdefault(part_a, set()).add(part_b)
                shared.setdefault(part_b, set()).add(part_a)
        return cls(rewritten, shared)

    def note(self, part: str) -> str:
        transforms = sorted(
            {t for path, t in self.rewritten.items() if _part_of(path, [part]) or _part_of(part, [path])}
        )
        if transforms:
            return f"rewritten by {', '.join(transforms)}"
        if part in self.shared:
            return f"shares fused work with {', '.join(sorted(self.shared[part]))}"
        return ""


def _roof_pct(
    part: str, captured_ms: float, roofs: list[RoofRow], parts: list[str], mixed: bool
) -> float | None:
    """The part's share of its roof: its module slices' roof time (summed over layers, so divided
    by the layers merged) against its time; None where a slice beat its roof, none has a roof,
    or layers of different kinds share the summed slices."""
    if mixed and LAYER.match(part):
        return None
    merged = summary_name(part)
    inside = [r for r in roofs if r.part.removesuffix(" (self)") == merged or r.part.startswith(merged + ".")]
    if not inside or any(r.roof_error or r.roof_ms is None for r in inside) or captured_ms <= 0:
        return None
    instances = sum(summary_name(p) == merged for p in parts)
    return 100 * sum(r.roof_ms for r in inside) / instances / captured_ms


def _groups(parts: list[str], kinds: dict[str, str]) -> list[tuple[str | None, list[str]]]:
    """The parts in forward order as (kind, parts) groups: those before the layers, the layers
    (one group per kind, in the order kinds first appear, where kinds differ; else one), those
    after. The kind is None for a group of parts that are not layers."""
    layers = [p for p in parts if LAYER.match(p)]
    if not layers:
        return [(None, parts)]
    first, last = parts.index(layers[0]), parts.index(layers[-1])
    groups: list[tuple[str | None, list[str]]] = [(None, parts[:first])]
    groups += [
        (kind, [p for p in layers if kinds.get(p, "") == kind])
        for kind in dict.fromkeys(kinds.get(p, "") for p in layers)
    ]
    groups.append((None, parts[last + 1 :]))
    return [(kind, members) for kind, members in groups if members]


def layer_rows(
    phase: str,
    captured: Phases,
    eager: Phases | None,
    parts: list[str],
    kinds: dict[str, str],
    unlike: Unlike,
    roofs: list[RoofRow],
    errors: dict[str, tuple[float | None, float | None, bool]],
) -> list[LayerRow]:
    """One phase's rows: the parts in forward order (layers grouped by kind where kinds differ,
    each kind's layers followed by a row summing them), the rest of the step, and the total.
    errors: part -> (max abs, max rel, first past tolerance), this phase's numerics."""
    ours, theirs = captured[phase], eager.get(phase) if eager is not None else None
    ours_modules, theirs_modules = _modules(ours), _modules(theirs)

    def row(name: str, kind: str, members: list[str], note: str) -> LayerRow:
        mine = [sum(_times(ours_modules, p)[i] for p in members) for i in range(3)]
        other = [sum(_times(theirs_modules, p)[i] for p in members) for i in range(3)]
        compared = compared_part(name, mine[0], other[0], tuple(mine[1:]), tuple(other[1:]))
        if theirs is None:
            compared.speedup, compared.note = None, "no eager reference (profile.reference=none)"
        elif note:
            compared.speedup, compared.note = None, note
        return LayerRow(**vars(compared), kind=kind)

    rows = []
    for kind, members in _groups(parts, kinds):
        for part in members:
            ran = any(_times(side, part)[0] >= MEASURABLE_US for side in (ours_modules, theirs_modules))
            if not ran and part not in errors:  # a part this phase does not run (a vision tower's decode)
                continue
            seen = _times(ours_modules, part)[0] >= MEASURABLE_US
            missing = "" if seen else "not seen in the profile (its work is inside a graph's own time)"
            layer = row(part, kind or "", [part], unlike.note(part) or missing)
            layer.pct_of_roof = _roof_pct(part, layer.captured_ms, roofs, parts, bool(kinds))
            layer.max_abs, layer.max_rel, layer.first_drift = errors.get(part, (None, None, False))
            rows.append(layer)
        if kind:
            notes = sorted({unlike.note(p) for p in members} - {""})
            rows.append(row(f"{kind} layers ({len(members)})", kind, members, "; ".join(notes)))
    counted = [r for r in rows if r.part in parts]
    rest = row(REST, "", [], "")
    whole = step_times(ours), step_times(theirs)
    for field_, side, index in (
        ("captured_ms", 0, 0), ("captured_busy_ms", 0, 1), ("captured_gap_ms", 0, 2),
        ("eager_ms", 1, 0), ("eager_busy_ms", 1, 1), ("eager_gap_ms", 1, 2),
    ):  # fmt: skip
        setattr(rest, field_, whole[side][index] / 1000 - sum(getattr(r, field_) for r in counted))
    rest.note = "outside the parts: embeddings, the final norm, the engine's own work, the time between parts"
    total = compared_part("total", whole[0][0], whole[1][0], whole[0][1:], whole[1][1:])
    return [*rows, rest, LayerRow(**vars(total))]

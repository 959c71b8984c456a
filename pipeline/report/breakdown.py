"""Breakdown tables of a profile.json, the data behind every plot: time per module bucket, per
kernel category and per kernel, for each phase shown (prefill, decode_1, decode = the mean)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pipeline.profiler.tree import UNATTRIBUTED

PHASES = ("prefill", "decode_1", "decode")
LAYER = re.compile(r"(^|\.)layers\.\*$")


def _modules_below(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in node["children"] if c["kind"] in ("module", "unattributed")]


def _has_layers(node: dict[str, Any]) -> bool:
    return bool(LAYER.search(node["fqn"])) or any(_has_layers(c) for c in _modules_below(node))


def module_buckets(
    summary: dict[str, Any], depth: int | None = None, value: Callable[[dict[str, Any]], float] | None = None
) -> dict[str, float]:
    """Disjoint parts of a phase's device time (us), by summary-tree module.

    Default: the children of the decoder layers (`layers.*.self_attn`, `layers.*.mlp`, the norms)
    and, outside the layers, the largest modules that hold no layers (lm_head, vision tower,
    projector, embedding, demollm's own steps); time a container spends itself is `<fqn> (self)`.
    With `depth`, the module nodes at that depth below the phase instead (shallower leaves as is).
    value: what is summed per node instead of its device time (one kernel category's time).
    """
    buckets: dict[str, float] = {}
    us = value or (lambda node: node["device_time_us"])

    def add(name: str, us: float) -> None:
        if us > 0:
            buckets[name] = buckets.get(name, 0.0) + us

    def visit(node: dict[str, Any], level: int) -> None:
        below = _modules_below(node)
        if depth is not None:
            stop = level >= depth or not below
        else:
            stop = not below or (not _has_layers(node) and not LAYER.search(node["fqn"]))
            if LAYER.search(node["fqn"]):  # a layer: its children are the buckets
                for child in below:
                    add(child["fqn"] or child["name"], us(child))
                add(f"{node['fqn']} (self)", us(node) - sum(us(c) for c in below))
                return
        if stop and level > 0:
            add(node["fqn"] or node["name"], us(node))
            return
        for child in below:
            visit(child, level + 1)
        if level > 0:
            add(f"{node['fqn'] or node['name']} (self)", us(node) - sum(us(c) for c in below))

    visit(summary, 0)
    return buckets


def kernel_times(tree: dict[str, Any], key: str) -> dict[str, float]:
    """Device time (us) of the kernel leaves, summed by `category` or by `name`."""
    totals: dict[str, float] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if node["kind"] == "kernel":
            totals[node[key] or "other"] = totals.get(node[key] or "other", 0.0) + node["device_time_us"]
        stack.extend(node["children"])
    return totals


def category_pct(phases: dict[str, dict[str, Any]], category: str) -> float:
    """The share (%) of one kernel category in the device time of all step windows together."""
    steps = [e for name, e in phases.items() if name != "decode"]
    total = sum(e["device_time_us"] for e in steps)
    part = sum(kernel_times(e["summary_stats"], "category").get(category, 0.0) for e in steps)
    return 100 * part / total if total else 0.0


def top_k(values: dict[str, float], k: int) -> dict[str, float]:
    """The k largest, the rest summed as `others`, in descending order."""
    ranked = sorted(values.items(), key=lambda kv: -kv[1])
    kept = dict(ranked[:k])
    rest = sum(v for _, v in ranked[k:])
    if rest > 0:
        kept["others"] = rest
    return kept


def phases_of(profile: dict[str, Any], wanted: tuple[str, ...] = PHASES) -> list[str]:
    return [p for p in wanted if p in profile["phases"]]


def parts_of(profile: dict[str, Any], phase: str, level: str, depth: int | None = None) -> dict[str, float]:
    """{part: device us} of one phase at level `module`, `category` or `kernel`."""
    summary = profile["phases"][phase]["summary_stats"]
    if level == "module":
        return module_buckets(summary, depth)
    if level in ("category", "kernel"):
        return kernel_times(summary, "category" if level == "category" else "name")
    raise ValueError(f"level {level!r}: use module, category or kernel")


def align(raw: dict[str, dict[str, float]], top: int) -> dict[str, dict[str, float]]:
    """Rows (phases, or jobs) with the same parts: the top-k over all rows together, the rest
    `others`; us -> ms."""
    overall: dict[str, float] = {}
    for values in raw.values():
        for name, us in values.items():
            overall[name] = overall.get(name, 0.0) + us
    keep = [name for name in top_k(overall, top) if name != "others"]
    result = {}
    for row, values in raw.items():
        parts = {name: values.get(name, 0.0) / 1000 for name in keep}
        rest = sum(us for name, us in values.items() if name not in keep) / 1000
        if rest > 0:
            parts["others"] = rest
        result[row] = parts
    return result


def breakdown(
    profile: dict[str, Any],
    level: str,
    top: int = 8,
    depth: int | None = None,
    phases: tuple[str, ...] = PHASES,
) -> dict[str, dict[str, float]]:
    """phase -> {part: device ms per step}, the same parts in every phase."""
    return align({phase: parts_of(profile, phase, level, depth) for phase in phases_of(profile, phases)}, top)


def long_table(profile: dict[str, Any], level: str, phases=("prefill", "decode")) -> dict[str, list]:
    """Columns phase, part, device_ms, pct (of the phase's step): every part of a level, for an
    MLflow table the UI compares across runs."""
    columns: dict[str, list] = {"phase": [], level: [], "device_ms": [], "pct": []}
    for phase in phases_of(profile, phases):
        parts = parts_of(profile, phase, level)
        total = sum(parts.values()) or 1.0
        for name, us in sorted(parts.items(), key=lambda kv: -kv[1]):
            columns["phase"].append(phase)
            columns[level].append(name)
            columns["device_ms"].append(round(us / 1000, 4))
            columns["pct"].append(round(100 * us / total, 2))
    return columns


# The top-level parts a phase's time is charted by across runs (MLflow metrics layers/<phase>/<part>_ms):
# a bounded set, whatever the family calls its modules.
PARTS = (
    "attention", "mlp", "norms", "lm_head", "embeddings", "vision_tower", "projector", "demollm",
    "unattributed", "other",
)  # fmt: skip
_IN_LAYER = re.compile(r"(^|\.)layers\.\*\.")
_VISION = re.compile(r"vision|visual|image_encoder|patch_embed")
_PROJECTOR = re.compile(r"projector|multi_modal|mm_proj|connector")


def part_of(bucket: str) -> str:
    """Which of PARTS a module bucket (module_buckets) belongs to: the decoder layers' attention,
    MLP (experts included) and norms summed over layers; the rest by what the module is."""
    name = bucket.removesuffix(" (self)")
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith(UNATTRIBUTED):
        return "unattributed"
    if name.startswith("demollm."):
        return "demollm"
    if _VISION.search(name):
        return "vision_tower"
    if _PROJECTOR.search(name):
        return "projector"
    if "lm_head" in name:
        return "lm_head"
    if "embed" in leaf:
        return "embeddings"
    if "norm" in leaf:
        return "norms"
    if _IN_LAYER.search(name) and not bucket.endswith(" (self)"):
        if "attn" in leaf or "attention" in leaf:
            return "attention"
        if any(word in leaf for word in ("mlp", "feed_forward", "moe", "expert")):
            return "mlp"
    return "other"


def part_times(summary: dict[str, Any]) -> dict[str, float]:
    """A phase's device time (us) per part of PARTS, every part present (0 where none)."""
    times = dict.fromkeys(PARTS, 0.0)
    for bucket, us in module_buckets(summary).items():
        times[part_of(bucket)] += us
    return times


def _rewritten_by(part: str, rewritten: dict[str, str]) -> str:
    """The model-scope transforms that rewrote a module of `part` (or the part itself), or ''. A
    container's own time (`<fqn> (self)`) is rewritten only where the container itself was."""
    own = part.endswith(" (self)")
    name = part.removesuffix(" (self)")
    for path, transforms in rewritten.items():
        path = _LAYER_INDEX.sub(".layers.*.", path + ".").rstrip(".")
        inside = path.startswith(name + ".") or name.startswith(path + ".")
        if path == name or (inside and not own):
            return transforms
    return ""


_LAYER_INDEX = re.compile(r"\.layers\.\d+\.")


def bucket_of(fqn: str, buckets: set[str]) -> str | None:
    """The module bucket (module_buckets) a module's work is counted in: the deepest bucket at or
    above it, layer indices as `*`; a container's own work goes to its `(self)` bucket."""
    path = _LAYER_INDEX.sub(".layers.*.", "." + fqn + ".").strip(".")
    if path in buckets:
        return path
    while path:
        if f"{path} (self)" in buckets:
            return f"{path} (self)"
        path = path.rsplit(".", 1)[0] if "." in path else ""
        if path in buckets:
            return path
    return None


def _fusion_edges(fused: dict[str, set[str]], names: set[str]) -> dict[str, set[str]]:
    """provenance.fused_modules at bucket level: bucket -> the other buckets whose kernels compute
    some of its work."""
    edges: dict[str, set[str]] = {}
    for source, targets in fused.items():
        a = bucket_of(source, names)
        for b in (bucket_of(t, names) for t in targets):
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)
    return edges


def _groups(edges: dict[str, set[str]]) -> dict[str, tuple[str, ...]]:
    """Bucket -> the buckets joined with it by fusion, transitively (itself included)."""
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
    """A bucket as the note names it: from the decoder layer down (`layers.*.self_attn`)."""
    match = re.search(r"(^|\.)(layers\.\*\..*)$", name)
    return match.group(2) if match else name


def comparison(
    captured: dict[str, Any],
    eager: dict[str, Any],
    phases=("prefill", "decode"),
    rewritten: dict[str, str] | None = None,
    fused: dict[str, set[str]] | None = None,
    graphs: tuple[str, ...] = (),
    moved: dict[str, dict[str, str]] | None = None,
) -> dict[str, list]:
    """Per phase, per module part (module_buckets): device ms per step of the captured run and of the
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
        ours = module_buckets(captured[phase]["summary_stats"])
        theirs = module_buckets(eager[phase]["summary_stats"])
        names = sorted(set(ours) | set(theirs), key=lambda n: -(ours.get(n, 0.0) + theirs.get(n, 0.0)))
        edges = _fusion_edges(fused or {}, set(names))
        by: dict[tuple[str, str], str] = {}  # bucket edge -> the graph transforms that made it
        for source, targets in (moved or {}).items():
            for target, transforms in targets.items():
                a, b = bucket_of(source, set(names)), bucket_of(target, set(names))
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
        rows, grouped = [], {}
        for name in names:
            row = compared_part(name, ours.get(name, 0.0), theirs.get(name, 0.0))
            if transforms := _rewritten_by(name, rewritten or {}):
                row.update(speedup=None, note=f"rewritten by {transforms}")
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
                row.update(speedup=None, note="; ".join(said) + " (ratio: the fused row)")
                grouped.setdefault(groups[name], []).append(name)
            elif name.startswith(UNATTRIBUTED):
                row.update(speedup=None, note="no module: not comparable")
            elif name.removesuffix(" (self)") in graphs and name.endswith(" (self)"):
                row.update(speedup=None, note="the graph's own ops: not the same work on both sides")
            elif name.startswith("demollm."):
                row.update(speedup=None, note="each runner's own bookkeeping: not the same work")
            elif phase == "prefill" and part_of(name) == "lm_head" and "" in graphs:
                row.update(
                    speedup=None,
                    note="the graph computes the lm_head on every prompt row, eager on the last: not the same work",
                )
            rows.append(row)
        for members in grouped.values():
            largest = _short(max(members, key=lambda n: theirs.get(n, 0.0)))
            group = compared_part(
                f"fused: {largest} + {len(members) - 1} more",
                sum(ours.get(n, 0.0) for n in members),
                sum(theirs.get(n, 0.0) for n in members),
            )
            group["note"] = (
                "the parts fused together (Inductor's kernels, a transform's nodes), summed on both sides"
            )
            rows.append(group)
        rows.sort(key=lambda r: -(r["captured_ms"] + r["eager_ms"]))
        rows.append(compared_part("total", captured[phase]["device_time_us"], eager[phase]["device_time_us"]))
        out[phase] = rows
    return out


# Below this a part's time per step is the profiler's rounding, not work: no ratio is taken of it
# (a residue of a part fused away once divided a real time into a ratio of 5e12).
MEASURABLE_US = 1.0


def compared_part(part: str, captured_us: float, eager_us: float) -> dict[str, Any]:
    measured = captured_us >= MEASURABLE_US and eager_us >= MEASURABLE_US
    note = ""
    if captured_us < MEASURABLE_US <= eager_us:
        note = "no time on the captured side: its work is in another part"
    elif eager_us < MEASURABLE_US <= captured_us:
        note = "captured side only"
    return {
        "part": part,
        "captured_ms": captured_us / 1000,
        "eager_ms": eager_us / 1000,
        "speedup": eager_us / captured_us if measured else None,
        "note": note,
    }


def comparison_table(rows: list[dict[str, Any]], phase: str, top: int = 12) -> str:
    header = f"{'part':<60} {'captured ms':>12} {'eager ms':>10} {'eager/captured':>15}  note"
    lines = [
        f"{phase}: captured vs Hugging Face generate (eager), device ms per step",
        header,
        "-" * len(header),
    ]
    shown = [r for r in rows if r["part"] != "total"][:top] + [r for r in rows if r["part"] == "total"]
    for r in shown:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        name = r["part"] if len(r["part"]) <= 60 else "..." + r["part"][-57:]
        lines.append(
            f"{name:<60} {r['captured_ms']:>12.3f} {r['eager_ms']:>10.3f} {speedup:>15}  {r.get('note', '')}".rstrip()
        )
    return "\n".join(lines)

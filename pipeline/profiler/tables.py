"""Printed tables of a profile (ProfileResults, so the stage and `python -m pipeline.tools.print_table`
print the same thing): a phase's tree with indentation, a depth cut and a top-k cut per node (the
rest folded into one `... N more` row), and the captured-vs-eager comparison."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.profiler.rows import ComparedPart, LayerRow, Phases, ProfileNode

NAME_WIDTH = 64


def _detail(node: ProfileNode) -> str:
    if node.kind == "module":
        return node.cls
    if node.kind == "kernel":
        return " ".join("x".join(map(str, s)) for s in node.shapes[:3])
    return ""


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(tree: ProfileNode, title: str, depth: int | None = None, top_k: int | None = None) -> str:
    header = f"{'name':<{NAME_WIDTH}} {'class / shapes':<28} {'device us':>11} {'%':>6} {'cpu us':>11} {'calls':>6}"
    lines = [title, header, "-" * len(header)]

    def row(name: str, level: int, detail: str, device: float, pct: float, cpu: float, calls: str) -> None:
        label = _cut("  " * level + name, NAME_WIDTH)
        lines.append(
            f"{label:<{NAME_WIDTH}} {_cut(detail, 28):<28} {device:>11.1f} {pct:>6.1f} {cpu:>11.1f} {calls:>6}"
        )

    def visit(node: ProfileNode, level: int) -> None:
        row(node.name, level, _detail(node), node.device_time_us, node.pct, node.cpu_time_us,
            str(node.invocations))  # fmt: skip
        if depth is not None and level >= depth:
            return
        children = node.children
        shown = children
        if top_k is not None and len(children) > top_k:
            keep = sorted(range(len(children)), key=lambda i: -children[i].device_time_us)[:top_k]
            shown = [children[i] for i in sorted(keep)]
        for child in shown:
            visit(child, level + 1)
        rest = [c for c in children if c not in shown]
        if rest:
            row(f"... {len(rest)} more", level + 1, "", sum(c.device_time_us for c in rest),
                sum(c.pct for c in rest), sum(c.cpu_time_us for c in rest), "")  # fmt: skip

    visit(tree, 0)
    return "\n".join(lines)


def phase_table(phases: Phases, phase: str, table: str, depth: int | None, top_k: int | None) -> str:
    """The `summary` or `model` table of one phase."""
    if phase not in phases:
        raise KeyError(f"no phase {phase!r} in this profile; it has {', '.join(phases)}")
    if table not in ("summary", "model"):
        raise KeyError(f"no table {table!r}: use summary or model")
    entry = phases[phase]
    statistic = f" ({entry.statistic})" if entry.statistic else ""
    title = (
        f"{phase} {table} table{statistic}: step {entry.step_ms:.2f} ms, device time "
        f"{entry.device_time_us:.0f} us, coverage {entry.coverage_pct:.1f} %"
    )
    return format_table(getattr(entry, f"{table}_stats"), title, depth, top_k)


def comparison_table(rows: list[ComparedPart], phase: str, top: int = 12) -> str:
    """The largest parts and the total: device ms per step on each side, each side's gaps (ms
    between its work), and the difference split into busy time saved and gaps removed."""
    header = (
        f"{'part':<56} {'captured ms':>11} {'gap':>7} {'eager ms':>9} {'gap':>7} {'eager/captured':>14} "
        f"{'busy saved':>10} {'gaps removed':>12}  note"
    )
    lines = [
        f"{phase}: captured vs Hugging Face generate (eager), device ms per step; gap: ms between the "
        "part's work (host time between ops on CPU, device idle between kernels on a GPU)",
        header,
        "-" * len(header),
    ]
    shown = [r for r in rows if r.part != "total"][:top] + [r for r in rows if r.part == "total"]
    for r in shown:
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        name = r.part if len(r.part) <= 56 else "..." + r.part[-53:]
        lines.append(
            f"{name:<56} {r.captured_ms:>11.3f} {r.captured_gap_ms:>7.3f} {r.eager_ms:>9.3f} "
            f"{r.eager_gap_ms:>7.3f} {speedup:>14} {r.busy_saved_ms:>10.3f} {r.gaps_removed_ms:>12.3f}  "
            f"{r.note}".rstrip()
        )
    return "\n".join(lines)


def _number(value: float | None, spec: str, width: int) -> str:
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def layer_table(rows: list[LayerRow], phase: str) -> str:
    """The per-layer table of one phase (profiler/layers.py)."""
    header = (
        f"{'part':<44} {'kind':<18} {'captured ms':>11} {'gap':>7} {'eager ms':>9} {'gap':>7} {'ratio':>7} "
        f"{'% roof':>6} {'max abs':>9} {'max rel':>9}  note"
    )
    lines = [
        f"{phase}: per layer, captured vs eager (device ms per step, gaps between the work), roof, "
        "numerics against eager (<< first past tolerance)",
        header,
        "-" * len(header),
    ]
    for r in rows:
        name = r.part if len(r.part) <= 44 else "..." + r.part[-41:]
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        lines.append(
            f"{name:<44} {_cut(r.kind, 18):<18} {r.captured_ms:>11.3f} {r.captured_gap_ms:>7.3f} "
            f"{r.eager_ms:>9.3f} {r.eager_gap_ms:>7.3f} {speedup:>7} {_number(r.pct_of_roof, '.1f', 6)} "
            f"{_number(r.max_abs, '.2e', 9)} {_number(r.max_rel, '.2e', 9)}"
            f"{' <<' if r.first_drift else ''}  {r.note}".rstrip()
        )
    return "\n".join(lines)

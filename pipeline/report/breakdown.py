"""Breakdown tables of a profile, the data behind every plot: time per module slice, per kernel
category and per kernel, for each phase shown (prefill, decode_1, decode = the mean)."""

from __future__ import annotations

from pipeline.profiler.parts import kernel_times, module_slices
from pipeline.profiler.rows import Phases

PHASES = ("prefill", "decode_1", "decode")


def top_k(values: dict[str, float], k: int) -> dict[str, float]:
    """The k largest, the rest summed as `others`, in descending order."""
    ranked = sorted(values.items(), key=lambda kv: -kv[1])
    kept = dict(ranked[:k])
    rest = sum(v for _, v in ranked[k:])
    if rest > 0:
        kept["others"] = rest
    return kept


def shown_phases(phases: Phases, wanted: tuple[str, ...] = PHASES) -> list[str]:
    return [p for p in wanted if p in phases]


def level_times(phases: Phases, phase: str, level: str, depth: int | None = None) -> dict[str, float]:
    """{module slice, category or kernel: device us} of one phase at level `module`, `category` or `kernel`."""
    summary = phases[phase].summary_stats
    if level == "module":
        return module_slices(summary, depth)
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
    stats: Phases,
    level: str,
    top: int = 8,
    depth: int | None = None,
    wanted: tuple[str, ...] = PHASES,
) -> dict[str, dict[str, float]]:
    """phase -> {part: device ms per step}, the same parts in every phase."""
    return align({p: level_times(stats, p, level, depth) for p in shown_phases(stats, wanted)}, top)


def long_table(stats: Phases, level: str, wanted=("prefill", "decode")) -> dict[str, list]:
    """Columns phase, part, device_ms, pct (of the phase's step): every part of a level, for an
    MLflow table the UI compares across runs."""
    columns: dict[str, list] = {"phase": [], level: [], "device_ms": [], "pct": []}
    for phase in shown_phases(stats, wanted):
        parts = level_times(stats, phase, level)
        total = sum(parts.values()) or 1.0
        for name, us in sorted(parts.items(), key=lambda kv: -kv[1]):
            columns["phase"].append(phase)
            columns[level].append(name)
            columns["device_ms"].append(round(us / 1000, 4))
            columns["pct"].append(round(100 * us / total, 2))
    return columns

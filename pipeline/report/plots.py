"""Breakdown plots (seaborn on matplotlib's Agg backend): one figure per level, two panels each,
absolute device time per step and percent of the step, one stacked bar per phase."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.profiler.parts import PARTS, busy_us, gap_us, part_times
from pipeline.profiler.results import ProfileResults
from pipeline.profiler.stepwise import Waterfall
from pipeline.report.breakdown import breakdown

LEVELS = {
    "module_breakdown": ("module", "Where the time goes, by module"),
    "kernel_categories": ("category", "Where the time goes, by kernel category"),
    "kernel_top": ("kernel", "Where the time goes, by kernel"),
}


MODEL_PREFIX = re.compile(r"^.*model\.")  # model.language_model.layers.*.mlp -> layers.*.mlp


def legend_labels(parts: list[str], width: int = 48) -> list[str]:
    """Module paths without the wrappers every one repeats (`model.`, `model.language_model.`), when
    they stay apart that way; then anything still long cut from the left."""
    short = [MODEL_PREFIX.sub("", p) or p for p in parts]
    if len(set(short)) < len(set(parts)):
        short = parts
    return [p if len(p) <= width else "..." + p[-(width - 3) :] for p in short]


def breakdown_figure(data: dict[str, dict[str, float]], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    frame = pd.DataFrame(data).T.fillna(0.0)  # rows: phases, columns: parts (ms)
    percent = frame.div(frame.sum(axis=1), axis=0) * 100
    sns.set_theme(style="whitegrid", context="notebook")
    colors = sns.color_palette("tab20", n_colors=max(len(frame.columns), 1))
    fig, axes = plt.subplots(1, 2, figsize=(15, 1.2 * len(frame) + 3.5), sharey=True)
    frame.plot(kind="barh", stacked=True, ax=axes[0], color=colors, legend=False, width=0.7)
    percent.plot(kind="barh", stacked=True, ax=axes[1], color=colors, legend=False, width=0.7)
    axes[0].set_xlabel("device time per step (ms)")
    axes[1].set_xlabel("% of the step's device time")
    axes[1].set_xlim(0, 100)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, legend_labels(labels), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06 + 0.025 * ((len(labels) + 2) // 3), 1, 1))
    return fig


def busy_gap_bars(profile: ProfileResults) -> dict[str, dict[str, tuple[float, float]]]:
    """Phase -> `<part> captured` / `<part> eager` -> (busy ms, gap ms) per step, for every part
    (parts.PARTS) with time on either side, largest first."""
    sides = {"captured": profile.phases}
    if profile.reference is not None:
        sides["eager"] = profile.reference.phases
    panels = {}
    for phase in ("prefill", "decode"):
        times = {
            side: (
                part_times(phases[phase].summary_stats, busy_us),
                part_times(phases[phase].summary_stats, gap_us),
            )
            for side, phases in sides.items()
            if phase in phases
        }
        if not times:
            continue
        total = {part: sum(busy[part] + gap[part] for busy, gap in times.values()) for part in PARTS}
        shown = sorted((part for part in PARTS if total[part] > 0), key=lambda part: -total[part])
        panels[phase] = {
            f"{part} {side}": (busy[part] / 1000, gap[part] / 1000)
            for part in shown
            for side, (busy, gap) in times.items()
        }
    return panels


def busy_gap_figure(panels: dict[str, dict[str, tuple[float, float]]], title: str):
    """One panel per phase, a bar per label: busy time and, stacked on it, the gaps (ms per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    busy_color, gap_color = sns.color_palette("tab10")[0], sns.color_palette("tab10")[1]
    rows = max(len(bars) for bars in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 0.32 * rows + 2.5), squeeze=False)
    for ax, (phase, bars) in zip(axes[0], panels.items(), strict=True):
        labels = list(bars)
        busy = [bars[label][0] for label in labels]
        gaps = [bars[label][1] for label in labels]
        ax.barh(labels, busy, color=busy_color, label="busy (ops or kernels running)")
        ax.barh(labels, gaps, left=busy, color=gap_color, label="gaps (between them)")
        ax.invert_yaxis()
        ax.set_title(phase)
        ax.set_xlabel("ms per step")
        ax.tick_params(axis="y", labelsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def render(
    profile: ProfileResults,
    out_dir: Path,
    formats: tuple[str, ...] = ("png",),
    top_k: int = 8,
    depth: int | None = None,
) -> tuple[dict[str, Path], list[str]]:
    """Every level's figure into out_dir; returns ({key: png path}, notes on what was skipped)."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written, notes = {}, []
    context = profile.context
    subtitle = f"{context.get('model', '')} {context.get('capture', '')} {context.get('backend', '')}".strip()
    for key, (level, title) in LEVELS.items():
        data = breakdown(profile.phases, level, top_k, depth)
        empty = [phase for phase, parts in data.items() if sum(parts.values()) <= 0]
        for phase in empty:
            notes.append(f"{key}: phase {phase} has no device time; left out")
            del data[phase]
        if not data:
            notes.append(f"{key}: no phase has data; no plot")
            continue
        fig = breakdown_figure(data, f"{title} ({subtitle})" if subtitle else title)
        for fmt in formats:
            fig.savefig(out_dir / f"{key}.{fmt}", dpi=110)
        plt.close(fig)
        written[key] = out_dir / f"{key}.png" if "png" in formats else out_dir / f"{key}.{formats[0]}"
    panels = busy_gap_bars(profile)
    if panels:
        fig = busy_gap_figure(panels, f"Busy time and gaps per part, captured and eager ({subtitle})")
        for fmt in formats:
            fig.savefig(out_dir / f"busy_gaps.{fmt}", dpi=110)
        plt.close(fig)
        written["busy_gaps"] = out_dir / ("busy_gaps.png" if "png" in formats else f"busy_gaps.{formats[0]}")
    return written, notes


def numerics_plot(parts: list[str], max_rel: list[float | None], tolerance: float, path: Path) -> Path:
    """Each part's max relative difference from eager along depth (log scale), the tolerance as a
    line; a part past it in red, one not readable left as a gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(parts) + 3), 4))
    floor = tolerance * 1e-6  # an exact match (0) still shows, at the bottom
    values = [max(v, floor) if v is not None else float("nan") for v in max_rel]
    ax.plot(range(len(parts)), values, marker="o", color="tab:blue")
    past = [(i, v) for i, v in enumerate(values) if v == v and v > tolerance]
    if past:
        ax.scatter(*zip(*past, strict=True), color="tab:red", zorder=3, label="past tolerance")
    ax.axhline(tolerance, color="tab:red", linestyle="--", linewidth=1, label=f"tolerance {tolerance:.0e}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(parts)), legend_labels(parts, 28), rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("max |captured - eager| / max |eager|")
    ax.set_title("Each part's output against eager, in forward order")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def waterfall_plot(step_parts: dict[str, dict[str, dict[str, float]]], path: Path) -> Path:
    """step_parts: phase -> step -> part -> device ms. One panel per phase, a stacked bar per step
    (eager first), so what each step took off (or added to) each part shows bar to bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    phases = list(step_parts)
    fig, axes = plt.subplots(1, len(phases), figsize=(7 * len(phases), 5))
    axes = list(axes) if len(phases) > 1 else [axes]
    parts = sorted(
        {p for steps in step_parts.values() for s in steps.values() for p, ms in s.items() if ms > 0}
    )
    colors = dict(zip(parts, sns.color_palette("tab10", n_colors=max(len(parts), 1)), strict=False))
    for ax, phase in zip(axes, phases, strict=True):
        frame = pd.DataFrame(step_parts[phase]).T.reindex(columns=parts).fillna(0.0)
        frame.plot(kind="bar", stacked=True, ax=ax, color=[colors[p] for p in parts], legend=False, width=0.7)
        ax.set_title(f"{phase}: device ms per step after each step")
        ax.set_ylabel("device ms per step")
        ax.tick_params(axis="x", labelrotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def waterfalls_figure(waterfalls: dict[str, Waterfall]):
    """Several jobs' waterfalls side by side (a sweep's parent): per phase, each job's median device
    ms per step after each step with its p10-p90 as error bars, relative to its own eager step
    (1.0), so models of any size share an axis; a step a job did not take is left out of its line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    order: list[str] = []
    for data in waterfalls.values():
        order += [s.name for s in data.steps if s.name not in order]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, phase in zip(axes, ("prefill", "decode"), strict=True):
        for job, data in waterfalls.items():
            times = [s.time(phase) for s in data.steps]
            eager = times[0].median
            ax.errorbar(
                [order.index(s.name) for s in data.steps],
                [t.median / eager for t in times],
                yerr=[
                    [(t.median - t.p10) / eager for t in times],
                    [(t.p90 - t.median) / eager for t in times],
                ],
                marker="o",
                capsize=3,
                label=job,
            )
        ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(order)), order, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{phase}: device ms per step, relative to eager")
    axes[0].set_ylabel("x eager's time (lower is faster)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig

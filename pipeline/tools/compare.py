"""Compare two finished runs, module by module and kernel category by category: where did the time
go differently? (A trace diff, per module.)

python -m pipeline.tools.compare A B [--phase decode] [--top-k 12] [--output diff.png]
    [--tracking-uri URI]

A and B are run folders (with profile/profile.json) or MLflow run ids (the run's folder when it is
on this machine, else its profile artifact). Differences are B - A in ms per step, largest first.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from pipeline.profiler.parts import kernel_times, module_slices
from pipeline.profiler.results import ProfileResults
from pipeline.tracking import run_file


class CompareError(Exception):
    pass


def _read(path: Path) -> ProfileResults:
    try:
        return ProfileResults.load(path)
    except ValueError as exc:
        raise CompareError(str(exc)) from None


def load_profile(ref: str, uri: str | None) -> tuple[str, ProfileResults]:
    """(label, profile.json) of a run folder or an MLflow run id."""
    folder = Path(ref)
    if folder.is_dir():
        path = folder / "profile" / "profile.json"
        if not path.exists():
            raise CompareError(f"{ref} has no profile/profile.json (did its profile stage run?)")
        return folder.name, _read(path)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            name, path = run_file(ref, "profile/profile.json", uri, Path(tmp))
        except LookupError as exc:
            raise CompareError(str(exc)) from None
        return name, _read(path)


def differences(
    a: ProfileResults, b: ProfileResults, phase: str
) -> dict[str, list[tuple[str, float, float]]]:
    """{"module": [(part, a ms, b ms)], "category": [...]}, largest |b - a| first."""
    for profile in (a, b):
        if phase not in profile.phases:
            raise CompareError(
                f"phase {phase!r} is not in both profiles; they have {', '.join(profile.phases)}"
            )
    summaries = (a.phases[phase].summary_stats, b.phases[phase].summary_stats)
    result = {}
    for level, times_of in (("module", module_slices), ("category", lambda s: kernel_times(s, "category"))):
        left, right = (times_of(s) for s in summaries)
        rows = [(name, left.get(name, 0.0) / 1000, right.get(name, 0.0) / 1000) for name in {*left, *right}]
        result[level] = sorted(rows, key=lambda r: -abs(r[2] - r[1]))
    return result


def table(rows: list[tuple[str, float, float]], labels: tuple[str, str], top: int) -> str:
    header = f"{'part':<56} {labels[0][:14]:>14} {labels[1][:14]:>14} {'B - A ms':>10} {'B / A':>7}"
    lines = [header, "-" * len(header)]
    for name, a, b in rows[:top]:
        ratio = f"{b / a:.2f}" if a else "-"
        lines.append(f"{name[-56:]:<56} {a:>14.3f} {b:>14.3f} {b - a:>+10.3f} {ratio:>7}")
    return "\n".join(lines)


def plot(
    diffs: dict[str, list[tuple[str, float, float]]], labels: tuple[str, str], top: int, output: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.35 * top + 2.5))
    for ax, (level, rows) in zip(axes, diffs.items(), strict=True):
        shown = rows[:top]
        names = [n if len(n) <= 40 else "..." + n[-37:] for n, _, _ in shown]
        deltas = [b - a for _, a, b in shown]
        colors = ["#c0392b" if d > 0 else "#2874a6" for d in deltas]
        ax.barh(names, deltas, color=colors)
        ax.axvline(0, color="#333", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_title(f"by {level}: B - A (ms per step); red = B slower")
    fig.suptitle(f"A = {labels[0]}   B = {labels[1]}")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="run folder or MLflow run id")
    parser.add_argument("b", help="run folder or MLflow run id")
    parser.add_argument("--phase", default="decode")
    parser.add_argument("--top-k", type=int, default=12)
    parser.add_argument("--output", type=Path, default=None, help="diverging bar plot (png, pdf, svg)")
    parser.add_argument("--tracking-uri", default=None, help="default: the embedded store")
    args = parser.parse_args(argv)
    try:
        (label_a, a), (label_b, b) = (load_profile(ref, args.tracking_uri) for ref in (args.a, args.b))
        diffs = differences(a, b, args.phase)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    labels = (label_a, label_b)
    for level, rows in diffs.items():
        print(f"{args.phase}, by {level} (A = {label_a}, B = {label_b})")
        print(table(rows, labels, args.top_k))
        print()
    if args.output:
        plot(diffs, labels, args.top_k, args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

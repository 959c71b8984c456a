"""Redraw a profile's breakdown plot from a saved profile.json, without rerunning.

python -m pipeline.tools.visualize --json-trace profile.json --level module|kernel|category
    --output breakdown.pdf [--top-k 8] [--depth N] [--phase prefill --phase decode]

The output format follows the file's suffix (png, pdf, svg). --level kernel plots the top-k
kernels, category the kernel categories, module the module breakdown (--depth: modules at that
depth instead of the decoder-layer children).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.profiler.results import ProfileResults
from pipeline.report.breakdown import PHASES, breakdown
from pipeline.report.plots import breakdown_figure

TITLES = {"module": "by module", "kernel": "by kernel", "category": "by kernel category"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-trace", type=Path, required=True, help="a run's profile/profile.json")
    parser.add_argument("--level", choices=sorted(TITLES), default="module")
    parser.add_argument("--output", type=Path, required=True, help="breakdown.png, .pdf or .svg")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--phase", action="append", help="repeatable; default: prefill, decode_1, decode")
    args = parser.parse_args(argv)
    if args.output.suffix not in (".png", ".pdf", ".svg"):
        print(f"error: --output {args.output}: use a .png, .pdf or .svg file", file=sys.stderr)
        return 2
    try:
        profile = ProfileResults.load(args.json_trace)
    except ValueError as exc:
        print(f"error: --json-trace {exc}", file=sys.stderr)
        return 2
    phases = tuple(args.phase or PHASES)
    missing = [p for p in phases if p not in profile.phases]
    if missing:
        print(
            f"error: --phase {missing[0]} is not in this profile; it has {', '.join(profile.phases)}",
            file=sys.stderr,
        )
        return 2
    data = {
        p: parts
        for p, parts in breakdown(profile.phases, args.level, args.top_k, args.depth, phases).items()
        if sum(parts.values()) > 0
    }
    if not data:
        print("error: no device time in the chosen phases", file=sys.stderr)
        return 2
    import matplotlib.pyplot as plt

    context = profile.context
    fig = breakdown_figure(
        data,
        f"Where the time goes, {TITLES[args.level]} ({context.get('model', '')} {context.get('backend', '')})",
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    plt.close(fig)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

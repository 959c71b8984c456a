"""Re-print a profile's tables from a saved profile.json, without rerunning.

python -m pipeline.tools.print_table --json-trace profile.json --phase decode --table summary
    [--depth N] [--top-k K]

--phase: prefill, decode_1 .. decode_N, or decode (the mean over the decode windows).
--table: summary (merged by name path: layers as one row) or model (one row per module instance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.profiler.results import ProfileResults
from pipeline.profiler.tables import phase_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-trace", type=Path, required=True, help="a run's profile/profile.json")
    parser.add_argument("--phase", default="decode")
    parser.add_argument("--table", choices=["summary", "model"], default="summary")
    parser.add_argument("--depth", type=int, default=None, help="deepest level shown (default: all)")
    parser.add_argument("--top-k", type=int, default=None, help="largest children per node (default: all)")
    args = parser.parse_args(argv)
    try:
        profile = ProfileResults.load(args.json_trace)
    except ValueError as exc:
        print(f"error: --json-trace {exc}", file=sys.stderr)
        return 2
    try:
        print(phase_table(profile.phases, args.phase, args.table, args.depth, args.top_k))
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

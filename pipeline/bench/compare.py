"""`python -m pipeline.bench.compare EARLIER.json LATER.json [--tolerance 10]`: two bench runs side by side.

The bench's claim is that its ratios (ours / Hugging Face, ours / a limit) hold when the machine's
speed does not: run it twice, an hour apart, and every ratio's median should agree within the
tolerance while the absolute step times may move by much more. This prints one line per figure
(the ratios first, then the absolute times for contrast) with the change between the runs, whether
either run marked it NOISY, and exits 1 when a ratio that neither run marked NOISY moved more than
the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from pipeline.bench import rounds
from pipeline.bench.decode import label

Figure = tuple[str, str, float, bool]  # (name, kind: "ratio" | "time", median, marked noisy)


def figures(results: dict) -> Iterator[Figure]:
    """Every ratio and absolute time of a BENCHMARKS.json, by a name both runs share."""
    speedup = results.get("load", {}).get("speedup")
    if isinstance(speedup, dict):  # per round since the load row took turns with Hugging Face's init
        yield "load: HF init / ours", "ratio", speedup["median"], rounds.is_noisy(speedup)
    touched = results.get("load", {}).get("speedup_touched")
    if touched is not None:  # both loads on memory touched first (older records lack it)
        yield "load: HF init / ours, touched memory", "ratio", touched["median"], rounds.is_noisy(touched)
    for decode in results.get("decode", []):
        for row in decode["rows"]:
            for runner in row["runners"]:
                name = f"{label(results, decode)} b{row['batch']} {runner['runner']}"
                noisy = set(runner["noisy_figures"])
                if "vs_reference" in runner:
                    yield (
                        f"{name} / HF eager",
                        "ratio",
                        runner["vs_reference"]["median"],
                        "vs_reference" in noisy,
                    )
                for figure in ("pct_of_read", "pct_of_gemv"):
                    limit = figure.removeprefix("pct_of_")
                    yield f"{name} % of {limit}", "ratio", runner[figure]["median"], figure in noisy
                yield f"{name} ms/step", "time", runner["decode_ms"]["median"], False
    for backends in results.get("backends", []):
        for row in backends["rows"]:
            if "error" in row:
                continue
            name = f"{backends['model']} {row['runner']}"
            if "vs_reference" in row:
                yield f"{name} / HF eager", "ratio", row["vs_reference"]["median"], row["noisy"]
            yield f"{name} ms/step", "time", row["decode_ms"]["median"], False
    for row in results.get("prefill", {}).get("rows", []):
        name = f"prefill {row['tokens']}"
        yield f"{name} % of GEMM", "ratio", row["pct_of_gemm"]["median"], row["noisy"]
        if "pct_of_pass" in row:
            yield f"{name} % of linears' pass", "ratio", row["pct_of_pass"]["median"], row["noisy"]
        yield f"{name} ms", "time", row["prefill_ms"]["median"], False


def compare(earlier: dict, later: dict, tolerance_pct: float) -> tuple[list[str], list[str]]:
    """(markdown lines, the names of ratios that moved more than the tolerance and were not NOISY)."""
    before = {name: (kind, value, noisy) for name, kind, value, noisy in figures(earlier)}
    lines = [
        f"Bench of {earlier['date']} against a later one ({later['date']}); other processes' CPU: "
        f"{earlier['machine_load']['other_cores']:.2f} and {later['machine_load']['other_cores']:.2f} cores. "
        f"A ratio holds when its median moved at most {tolerance_pct:g} %.",
        "",
        "| figure | earlier | later | change | |",
        "|---|---|---|---|---|",
    ]
    hosts = [run.get("machine", {}).get("isa") for run in (earlier, later)]
    if None not in hosts and hosts[0] != hosts[1]:
        lines[1:1] = [
            "",
            f"DIFFERENT HOSTS: the CPUs' extensions differ ({hosts[0]} against {hosts[1]}): the runs "
            "ran different kernels, so a moved ratio says nothing about the method.",
        ]
    moved = []
    rows = sorted(figures(later), key=lambda f: f[1] != "ratio")  # ratios first, then times
    for name, kind, value, noisy in rows:
        if name not in before:
            continue
        _, earlier_value, earlier_noisy = before[name]
        change = 100 * (value / earlier_value - 1)
        verdict = ""
        if kind == "ratio":
            if earlier_noisy or noisy:
                verdict = "NOISY in a run"
            elif abs(change) <= tolerance_pct:
                verdict = "holds"
            else:
                verdict = "MOVED"
                moved.append(name)
        lines.append(f"| {name} | {earlier_value:.3g} | {value:.3g} | {change:+.1f} % | {verdict} |")
    return lines, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("earlier", type=Path)
    parser.add_argument("later", type=Path)
    parser.add_argument("--tolerance", type=float, default=10.0, help="percent a ratio's median may move")
    args = parser.parse_args()
    lines, moved = compare(
        json.loads(args.earlier.read_text()), json.loads(args.later.read_text()), args.tolerance
    )
    print("\n".join(lines))
    if moved:
        print(f"\n{len(moved)} ratio(s) moved more than {args.tolerance:g} %: {', '.join(moved)}")
        sys.exit(1)


if __name__ == "__main__":
    main()

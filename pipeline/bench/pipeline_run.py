"""The whole default `make run` as a user runs it, timed, with its stage times and the profiler's
overhead and coverage read from the run's summary.json; repeated, each figure with its spread."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import REPO_ROOT
from pipeline.bench import rounds

STAGE_TIMES = tuple(
    f"stage/{name}_s"
    for name in ("load", "export", "transforms", "capture", "numerics", "generate", "profile", "report")
)
PROFILE_FIGURES = ("profile/overhead_ratio", "profile/coverage_pct", "profile/layer_coverage_pct")
MAKE_RUN_TARGET_S = 120.0


def bench_pipeline_run(overrides: list[str], repeats: int) -> dict:
    """`repeats` whole runs one after another; a failed run ends the row with its error."""
    runs = []
    for _ in range(repeats):
        run = _one_run(overrides)
        if "error" in run:
            return {"overrides": overrides, **run}
        runs.append(run)
    figures = {k for run in runs for k in run["metrics"]}
    return {
        "overrides": overrides,
        "repeats": repeats,
        "wall_s": rounds.spread([run["wall_s"] for run in runs]),
        # a figure some run did not log (compile time without a compile backend) is left out
        "metrics": {
            k: rounds.spread([run["metrics"][k] for run in runs])
            for k in sorted(figures)
            if all(k in run["metrics"] for run in runs)
        },
    }


def _one_run(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                *overrides,
                "tracking.enabled=false",
                f"hydra.run.dir={tmp}/run",
            ],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        )
        wall = time.perf_counter() - start
        summary_path = Path(tmp) / "run" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "no summary"}
    if proc.returncode != 0:
        return {"wall_s": wall, "status": summary.get("status"), "error": proc.stderr[-500:]}
    metrics = summary["metrics"]
    kept = (*STAGE_TIMES, *PROFILE_FIGURES, "capture/compile_s", "latency/decode_ms")
    return {"wall_s": wall, "metrics": {k: metrics[k] for k in kept if k in metrics}}


def markdown(result: dict) -> list[str]:
    title = f"## Whole run: `python -m pipeline {' '.join(result['overrides'])}`"
    if "error" in result:
        return [title, "", f"Failed after {result['wall_s']:.0f} s: {result['error']}"]
    metrics = result["metrics"]
    stages = ", ".join(
        f"{k.removeprefix('stage/').removesuffix('_s')} {rounds.shown(metrics[k], 1, ' s')}"
        for k in STAGE_TIMES
        if k in metrics
    )
    compile_s = (
        f"; compile {rounds.shown(metrics['capture/compile_s'], 1, ' s')}"
        if "capture/compile_s" in metrics
        else ""
    )
    nan = {"median": float("nan"), "p10": float("nan"), "p90": float("nan")}
    overhead, coverage, layers = (metrics.get(k, nan) for k in PROFILE_FIGURES)
    return [
        title,
        "",
        f"{result['repeats']} runs one after another, each figure the median (p10-p90). Wall time "
        f"{rounds.shown(result['wall_s'], 0, ' s')} (target < {MAKE_RUN_TARGET_S:.0f} s, set-up done): "
        f"{stages}{compile_s}." + (f" Measured {result['measured']}." if "measured" in result else ""),
        # a block taken over from a part run (`--rows run`) says when and where
        "",
        "| profiler | value | target |",
        "|---|---|---|",
        f"| profiled / unprofiled decode step | {rounds.shown(overhead, 2, 'x')} | at most 3x |",
        f"| device time inside a module | {rounds.shown(coverage, 1, ' %')} | at least 99 % |",
        f"| layer stacks' time inside a layer | {rounds.shown(layers, 1, ' %')} | at least 95 % |",
    ]

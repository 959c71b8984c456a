"""The whole default `make run` as a user runs it, timed, with its stage times and the profiler's
overhead and coverage read from the run's summary.json."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import REPO_ROOT

STAGE_TIMES = tuple(
    f"stage/{name}_s" for name in ("load", "export", "transforms", "capture", "generate", "profile", "report")
)
MAKE_RUN_TARGET_S = 120.0


def bench_pipeline_run(overrides: list[str]) -> dict:
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
        return {
            "overrides": overrides,
            "wall_s": wall,
            "status": summary.get("status"),
            "error": proc.stderr[-500:],
        }
    metrics = summary["metrics"]
    return {
        "overrides": overrides,
        "wall_s": wall,
        "status": summary["status"],
        "stages": {k: metrics[k] for k in STAGE_TIMES if k in metrics},
        "compile_s": metrics.get("capture/compile_s"),
        "profile": {k: metrics[k] for k in metrics if k.startswith("profile/")},
        "decode_ms": metrics.get("latency/decode_ms"),
    }


def markdown(result: dict) -> list[str]:
    title = f"## Whole run: `python -m pipeline {' '.join(result['overrides'])}`"
    if "error" in result:
        return [title, "", f"Failed after {result['wall_s']:.0f} s: {result['error']}"]
    stages = ", ".join(
        f"{k.removeprefix('stage/').removesuffix('_s')} {v:.1f} s" for k, v in result["stages"].items()
    )
    profile = result["profile"]
    return [
        title,
        "",
        f"Wall time {result['wall_s']:.0f} s (target < {MAKE_RUN_TARGET_S:.0f} s, set-up done): {stages}; "
        f"compile {result['compile_s'] or 0:.1f} s.",
        "",
        "| profiler | value | target |",
        "|---|---|---|",
        f"| profiled / unprofiled decode step | {profile.get('profile/overhead_ratio', float('nan')):.2f}x | at most 3x |",
        f"| device time inside a module | {profile.get('profile/coverage_pct', float('nan')):.1f} % | at least 99 % |",
        f"| layer stacks' time inside a layer | {profile.get('profile/layer_coverage_pct', float('nan')):.1f} % | at least 95 % |",
    ]

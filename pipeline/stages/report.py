"""report: breakdown plots of the saved profile (plots/, and MLflow images under fixed keys) and
the run report (report/report.md, report/report.html). A failed run gets the same report of what
it reached, written by the runner through `write_for_failure`.

Tensor-parallel ranks meet here first (pipeline/ranks.py): rank 0's report then compares every
rank's profile; the other ranks end with their folder, part of rank 0's run."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.parallel import meet
from pipeline.profiler.results import ProfileResults
from pipeline.report.plots import render
from pipeline.report.ranks import rank_metrics, rank_profiles
from pipeline.report.run_report import write_report
from pipeline.state import RunState, StageResult

log = logging.getLogger(__name__)


def _plots(state: RunState) -> tuple[dict[str, Path], list[str]]:
    path = state.run_dir / "profile" / "profile.json"
    if not path.exists():
        return {}, ["no profile, so no breakdown plots"]
    cfg = state.cfg.report
    return render(
        ProfileResults.load(path), state.run_dir / "plots", tuple(cfg.formats), cfg.top_k, cfg.depth
    )


def run(state: RunState) -> StageResult:
    metrics = {}
    if state.rank is not None:
        meet(state.cfg.runtime.collective_timeout_s)
        if state.rank.rank > 0:
            return StageResult(notes=[f"rank {state.rank.rank}: rank 0's report covers this rank's folder"])
        metrics = rank_metrics(rank_profiles(state.run_dir, state.rank.world))
    if not state.cfg.report.enabled:
        return StageResult(metrics=metrics, notes=["report.enabled=false: no report"])
    plots, notes = _plots(state)
    md, page = write_report(state, plots, notes)
    artifacts = [page.parent] + ([state.run_dir / "plots"] if plots else [])
    return StageResult(
        metrics=metrics,
        artifacts=artifacts,
        images={f"breakdown_{key}": png for key, png in plots.items()},
        notes=[*notes, f"{len(plots)} plots in {state.run_dir / 'plots'}; report: {page}"],
    )


def write_for_failure(state: RunState) -> list[Path]:
    """The report of a run that stopped; never raises (the run's own failure is what matters)."""
    try:
        plots, notes = _plots(state)
    except Exception as exc:  # a broken plot must not hide why the run stopped
        plots, notes = {}, [f"plots failed: {exc}"]
    try:
        md, page = write_report(state, plots, notes)
    except Exception:
        log.exception("the report of the failed run could not be written")
        return []
    return [page.parent] + ([state.run_dir / "plots"] if plots else [])

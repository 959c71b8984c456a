"""Sweeps as one parent MLflow run with a child run per job, and a comparison when the sweep ends.

`SweepCallback` is a Hydra callback (conf/config.yaml, hydra.callbacks.sweep). In the launcher
process, before any job starts, it creates the experiment (and so the SQLite schema) and the
parent run, and hands the parent's id to the jobs through the environment (inherited by joblib
workers). Each job writes `summary.json` in its folder (the runner does, or the job function via
`record_job_failure` when it failed before its runner started), so the comparison reads files and
lists every job, failed ones with their stage and cause, whatever MLflow saw.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.report.document import Image, Section, Table, write
from pipeline.tracking import Tracker, flatten_params

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"  # each job's outcome, written by the runner
SWEEP_PARENT_ENV = "PIPELINE_SWEEP_PARENT_RUN_ID"  # the parent run's id, for the jobs
SWEEP_KEYS_ENV = "PIPELINE_SWEEP_KEYS"  # the keys the sweep varies: a job is named by their values
FAILED_JOBS: list[str] = []  # "<job>: <cause>" of the last sweep, for the exit code


def record_job_failure(config: DictConfig, folder: Path, name: str, error: BaseException) -> None:
    """summary.json for a job that failed before its runner wrote one (a config mistake, a model
    refused before loading), so the comparison lists it."""
    if (folder / SUMMARY_FILE).exists():
        return
    summary = {
        "name": name,
        "status": "FAILED",
        "failed_stage": "validate",
        "error": str(error).splitlines()[0] if str(error) else type(error).__name__,
        "run_id": None,
        "tags": {"capture": str(config.capture.mode), "backend": str(config.backend.name)},
        "metrics": {},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))


COLUMNS = (
    ("latency/prefill_ms", "prefill ms"),
    ("latency/decode_ms", "decode ms/step"),
    ("throughput/decode_tok_s", "tok/s"),
    ("correctness/max_abs_err", "max_abs_err"),
    ("profile/coverage_pct", "profile coverage %"),
)


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys a sweep varies: `capture=none,full` or `seed=range(3)` (not `model=x`)."""
    keys = []
    for override in overrides:
        key, _, value = override.partition("=")
        if "," in value or value.startswith(("range(", "choice(", "glob(", "interval(")):
            keys.append(key.lstrip("+~"))
    return keys


def job_name(task_overrides: list[str]) -> str | None:
    """A sweep job's name: its values of the swept keys, e.g. `capture=full backend=torch-compile`."""
    keys = [k for k in os.environ.get(SWEEP_KEYS_ENV, "").split(",") if k]
    chosen = [o for o in task_overrides if o.partition("=")[0].lstrip("+~") in keys]
    return " ".join(chosen) or None


def _job_config(config: DictConfig) -> DictConfig:
    plain = OmegaConf.to_container(config, resolve=False)
    plain.pop("hydra", None)
    return OmegaConf.create(plain)


def read_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every job's summary.json under the sweep folder, in job order, with its folder."""
    jobs = []

    def job_number(path: Path) -> int:
        head = path.parent.name.split("_")[0]
        return int(head) if head.isdigit() else 1 << 30

    for path in sorted(sweep_dir.glob(f"*/{SUMMARY_FILE}"), key=job_number):
        job = json.loads(path.read_text())
        job["folder"] = str(path.parent)
        jobs.append(job)
    return jobs


def _decode_figure(jobs: list[dict[str, Any]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = [
        {
            "capture": j["tags"].get("capture", "?"),
            "backend": j["tags"].get("backend", "?"),
            "job": j["name"],
            "decode ms/step": j["metrics"].get("latency/decode_ms", 0.0),
            "status": j["status"],
        }
        for j in jobs
    ]
    frame = pd.DataFrame(rows)
    sns.set_theme(style="whitegrid")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    sns.barplot(frame, x="capture", y="decode ms/step", hue="backend", ax=ax, errorbar=None)
    for i, job in enumerate(j for j in rows if j["status"] != "FINISHED"):
        ax.annotate(f"{job['job']}: {job['status']}", (0.01, 0.95 - 0.06 * i), xycoords="axes fraction",
                    fontsize=8, color="#b00020")  # fmt: skip
    ax.set_title("Decode step time by capture mode and backend (failed jobs: 0)")
    fig.tight_layout()
    return fig


def compare(
    sweep_dir: Path, jobs: list[dict[str, Any]], top: int = 8
) -> tuple[list[Section], dict[str, Path]]:
    """The comparison sections and plots (written under sweep_dir/report/)."""
    import matplotlib.pyplot as plt

    from pipeline.report.breakdown import align, parts_of
    from pipeline.report.plots import breakdown_figure

    out = sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    failed = [j for j in jobs if j["status"] != "FINISHED"]
    table = Table(
        ["job", "status", "failed stage", "cause", *[label for _, label in COLUMNS], "run folder"],
        [
            [
                j["name"],
                j["status"],
                j["failed_stage"],
                j["error"],
                *[j["metrics"].get(key, "") for key, _ in COLUMNS],
                j["folder"],
            ]  # fmt: skip
            for j in jobs
        ],
    )
    plots: dict[str, Path] = {}
    if jobs:
        fig = _decode_figure(jobs)
        plots["sweep_decode_ms"] = out / "decode_ms.png"
        fig.savefig(plots["sweep_decode_ms"], dpi=110)
        plt.close(fig)
    profiles = {}
    for job in jobs:
        path = Path(job["folder"]) / "profile" / "profile.json"
        if path.exists():
            profile = json.loads(path.read_text())
            if "decode" in profile["phases"]:
                profiles[job["name"]] = parts_of(profile, "decode", "module")
    if profiles:
        fig = breakdown_figure(align(profiles, top), "Decode step by module, job by job")
        plots["sweep_module_breakdown"] = out / "module_breakdown.png"
        fig.savefig(plots["sweep_module_breakdown"], dpi=110)
        plt.close(fig)
    sections = [
        Section("Jobs", [f"{len(jobs)} jobs, {len(failed)} failed.", table]),
        Section("Plots", [Image(p, k.replace("_", " ")) for k, p in plots.items()]),
    ]
    return sections, plots


class SweepCallback(Callback):
    def __init__(self) -> None:
        self.tracker: Tracker | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        overrides = list(config.hydra.overrides.task)
        tracking = config.tracking
        self.tracker = Tracker(tracking.uri, tracking.experiment, sweep_dir, tracking.enabled)
        params = flatten_params(_job_config(config)) | {"sweep.overrides": " ".join(overrides)}
        keys = swept_keys(overrides)
        swept = [o for o in overrides if o.partition("=")[0].lstrip("+~") in keys]
        tags = {"sweep": "parent", "run_dir": str(sweep_dir.resolve())}
        self.tracker.start(f"sweep {' '.join(swept or overrides)}"[:250], tags, params)
        if self.tracker.run_id:
            os.environ[SWEEP_PARENT_ENV] = self.tracker.run_id
        os.environ[SWEEP_KEYS_ENV] = ",".join(keys)
        (sweep_dir / "sweep.json").write_text(
            json.dumps({"parent_run_id": self.tracker.run_id, "overrides": overrides})
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        os.environ.pop(SWEEP_PARENT_ENV, None)
        os.environ.pop(SWEEP_KEYS_ENV, None)
        jobs = read_jobs(sweep_dir)
        FAILED_JOBS[:] = [
            f"{j['name']}: {j['failed_stage']}: {j['error']}" for j in jobs if j["status"] != "FINISHED"
        ]
        try:
            sections, plots = compare(sweep_dir, jobs)
            md, page = write(
                sweep_dir / "report", "sweep", f"Sweep: {' '.join(config.hydra.overrides.task)}", sections
            )
            log.info(
                "sweep: %d jobs, %d failed; comparison: %s",
                len(jobs),
                sum(j["status"] != "FINISHED" for j in jobs),
                page,
            )
        except Exception:  # the jobs' own results stand; a broken comparison must not hide them
            log.exception("the sweep comparison could not be written")
            plots = {}
        if self.tracker is None:
            return
        self.tracker.set_tags(
            {"jobs": str(len(jobs)), "failed_jobs": str(sum(j["status"] != "FINISHED" for j in jobs))}
        )
        self.tracker.log_artifact(sweep_dir / "report")
        for key, path in plots.items():
            self.tracker.log_image(key, path)
        self.tracker.end("FINISHED")

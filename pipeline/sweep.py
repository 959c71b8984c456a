"""Sweeps as one parent MLflow run with a child run per job, and a comparison when the sweep ends.

`SweepCallback` is a Hydra callback (conf/config.yaml, hydra.callbacks.sweep). In the launcher
process, before any job starts, it creates the experiment (and so the SQLite schema) and the
parent run, and writes the parent's id and the swept keys to `sweep.json` in the sweep folder,
where every job reads them (`this_sweep`): a file, not the environment, because a job of a cluster
launcher (submitit on SLURM, Ray) does not inherit the launcher's environment, while the sweep
folder is shared by construction. Each job writes `summary.json` in its folder (the runner does,
or the job function via `record_job_failure` when it failed before its runner started), so the
comparison reads files and lists every job, failed ones with their stage and cause, whatever
MLflow saw.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline import run_identity
from pipeline.report.document import Image, Section, Table, write
from pipeline.tracking import Tracker

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"  # each job's outcome, written by the runner
SWEEP_FILE = "sweep.json"  # in the sweep folder: the parent run's id and the swept keys, for the jobs
FAILED_JOBS: list[str] = []  # "<job>: <cause>" of the last sweep, for the exit code


def record_job_failure(
    config: DictConfig, folder: Path, name: str, error: BaseException, overrides: list[str]
) -> None:
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
        "overrides": overrides,
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


def swept(overrides: list[str]) -> dict[str, list[str]]:
    """The keys a sweep varies and their values, in the command line's order: `capture=none,full`
    or `seed=range(3)` (not `model=x`); values of choice()/glob()/interval() are not listed."""
    keys: dict[str, list[str]] = {}
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        if value.startswith("range("):
            keys[key] = [str(v) for v in range(*(int(a) for a in value[6:-1].split(",")))]
        elif value.startswith(("choice(", "glob(", "interval(")):
            keys[key] = []
        elif "," in value:
            keys[key] = value.split(",")
    return keys


def swept_keys(overrides: list[str]) -> list[str]:
    return list(swept(overrides))


def fixed_overrides(overrides: list[str]) -> list[str]:
    keys = swept(overrides)
    return [o for o in overrides if o.partition("=")[0].lstrip("+~") not in keys]


def job_values(task_overrides: list[str], keys: list[str]) -> dict[str, str]:
    """A job's value of each swept key, in the sweep's order."""
    given = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in task_overrides}
    return {k: given[k] for k in keys if k in given}


def this_sweep() -> dict[str, Any]:
    """In a sweep's job, what the launcher wrote to the sweep folder's sweep.json (parent_run_id,
    swept: key -> values); {} outside a sweep."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return {}
    path = Path(HydraConfig.get().sweep.dir) / SWEEP_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def job_name(task_overrides: list[str], keys: dict[str, list[str]]) -> str | None:
    """A sweep job's name: its values of the swept keys (run_identity.child_name), e.g.
    `qwen3·partial` for model=tiny_qwen3 in a sweep of model=tiny_qwen3,tiny_gemma2 x capture."""
    values = job_values(task_overrides, list(keys))
    return run_identity.child_name(list(values.items()), keys) if values else None


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


def _axes_of(keys: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(x, colour, facets) of the comparison plot: capture on x and backend as colour when swept,
    other swept keys in their place; the model, and every key left, facets (a panel per value:
    models' step times differ by orders of magnitude and are never drawn on one scale)."""
    rest = list(keys)

    def take(preferred: str) -> str | None:
        key = preferred if preferred in rest else next((k for k in rest if k != "model"), None)
        if key:
            rest.remove(key)
        return key

    return take("capture"), take("backend"), rest


def job_rows(jobs: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """One row per job: its swept values, status and decode step time with its spread."""
    rows = []
    for j in jobs:
        values = job_values(j.get("overrides", []), keys)
        m = j["metrics"]
        rows.append(
            {
                **{k: values.get(k, "?") for k in keys},
                "job": j["name"],
                "status": j["status"],
                "failed_stage": j["failed_stage"],
                "decode_ms": m.get("latency/decode_ms"),
                "p10": m.get("latency/decode_p10_ms"),
                "p90": m.get("latency/decode_p90_ms"),
                "noisy": j["tags"].get("noisy") == "true",
            }
        )
    return rows


def decode_figure(rows: list[dict[str, Any]], keys: list[str]):
    """Decode step time per job: a panel per value of the facet keys (each with its own scale:
    models differ by orders of magnitude), x and colour as `_axes_of` says; a bar is the median
    step with p10-p90 whiskers; a failed job is a hatched red bar across the panel, never 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    x, hue, facets = _axes_of(keys)

    def facet_of(row: dict[str, Any]) -> str:
        return ", ".join(f"{k.rsplit('.', 1)[-1]}={row[k]}" for k in facets) or "all jobs"

    panels = list(dict.fromkeys(facet_of(r) for r in rows))
    x_of = (lambda r: r[x]) if x else (lambda r: r["job"])  # noqa: E731 - nothing swept but facets
    hues = list(dict.fromkeys(r[hue] for r in rows)) if hue else [""]
    colors = dict(zip(hues, sns.color_palette("tab10", n_colors=max(len(hues), 1)), strict=False))
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(max(4.5, 1.2 * len(rows) / len(panels)) * len(panels), 4.8),
        squeeze=False,
    )
    width = 0.8 / len(hues)
    for ax, panel in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if facet_of(r) == panel]
        xs = list(dict.fromkeys(x_of(r) for r in mine))
        done = [r["decode_ms"] for r in mine if r["status"] == "FINISHED" and r["decode_ms"] is not None]
        top = max([r["p90"] or r["decode_ms"] for r in mine if r["decode_ms"] in done] + [1e-9]) * 1.25
        for r in mine:
            i, k = xs.index(x_of(r)), hues.index(r[hue]) if hue else 0
            left = i - 0.4 + k * width
            if r["status"] == "FINISHED" and r["decode_ms"] is not None:
                ax.bar(left, r["decode_ms"], width, align="edge", color=colors[hues[k]])
                if r["p10"] is not None and r["p90"] is not None:
                    center = left + width / 2
                    ax.vlines(center, r["p10"], r["p90"], color="black", linewidth=1)
                label = f"{r['decode_ms']:.3g}" + (" noisy" if r["noisy"] else "")
                ax.text(left + width / 2, r["decode_ms"], label, ha="center", va="bottom", fontsize=7)
            else:
                height = top if done else 1.0
                ax.bar(left, height, width, align="edge", fill=False, hatch="//", edgecolor="#b00020")
                ax.text(left + width / 2, height * 0.5, f"{r['status']}\n{r['failed_stage']}", ha="center",
                        va="center", fontsize=9, color="#b00020", rotation=90)  # fmt: skip
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(x or "job")
        ax.set_ylabel("decode ms/step (median, p10-p90)")
        if not done:
            ax.set_yticks([])
        ax.set_title(f"{panel}: {len(done)} of {len(mine)} finished", fontsize=10)
    if hue:
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[h]) for h in hues]
        fig.legend(handles, hues, title=hue, loc="upper right", fontsize=8)
    failed = sum(r["status"] != "FINISHED" for r in rows)
    fig.suptitle(
        f"Decode step time, {len(rows)} jobs ({failed} failed, drawn hatched)"
        + (f", one panel per {' x '.join(facets)}" if facets else "")
    )
    fig.tight_layout(rect=(0, 0, 0.9 if hue else 1, 0.94))
    return fig


def summary_metrics(rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, str]]:
    """The parent's metrics (jobs, failed, best and worst decode ms) and tags naming those jobs."""
    done = [r for r in rows if r["status"] == "FINISHED" and r["decode_ms"] is not None]
    metrics = {
        "sweep/jobs": len(rows),
        "sweep/failed": sum(r["status"] != "FINISHED" for r in rows),
        "sweep/noisy": sum(r["noisy"] for r in rows),
    }
    tags = {}
    if done:
        best, worst = min(done, key=lambda r: r["decode_ms"]), max(done, key=lambda r: r["decode_ms"])
        metrics |= {"sweep/best_decode_ms": best["decode_ms"], "sweep/worst_decode_ms": worst["decode_ms"]}
        tags = {"best_job": best["job"], "worst_job": worst["job"]}
    return metrics, tags


def compare(
    sweep_dir: Path, jobs: list[dict[str, Any]], keys: list[str], top: int = 8
) -> tuple[list[Section], dict[str, Path]]:
    """The comparison sections and plots (written under sweep_dir/report/)."""
    import matplotlib.pyplot as plt

    from pipeline.profiler import stepwise
    from pipeline.profiler.results import ProfileResults
    from pipeline.report.breakdown import align, level_times
    from pipeline.report.plots import breakdown_figure, busy_gap_figure, waterfalls_figure

    out = sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    failed = [j for j in jobs if j["status"] != "FINISHED"]
    table = Table(
        ["job", "status", "failed stage", "cause", *[label for _, label in COLUMNS], "noisy", "run folder"],
        [
            [
                j["name"],
                j["status"],
                j["failed_stage"],
                j["error"],
                *[j["metrics"].get(key, "") for key, _ in COLUMNS],
                j["tags"].get("noisy", ""),
                Path(j["folder"]).name,
            ]  # fmt: skip
            for j in jobs
        ],
    )
    plots: dict[str, Path] = {}
    if jobs:
        fig = decode_figure(job_rows(jobs, keys), keys)
        plots["sweep_decode_ms"] = out / "decode_ms.png"
        fig.savefig(plots["sweep_decode_ms"], dpi=110)
        plt.close(fig)
    profiles, steps = {}, {}
    for job in jobs:
        path = Path(job["folder"]) / "profile" / "profile.json"
        if path.exists():
            phases = ProfileResults.load(path).phases
            if "decode" in phases:
                profiles[job["name"]] = level_times(phases, "decode", "module")
            for phase in ("prefill", "decode"):
                if phase in phases:
                    root = phases[phase].model_stats
                    steps.setdefault(phase, {})[job["name"]] = (root.busy_us / 1000, root.gap_us / 1000)
    if profiles:
        fig = breakdown_figure(align(profiles, top), "Decode step by module, job by job")
        plots["sweep_module_breakdown"] = out / "module_breakdown.png"
        fig.savefig(plots["sweep_module_breakdown"], dpi=110)
        plt.close(fig)
    if steps:
        fig = busy_gap_figure(steps, "Each job's step: busy time and gaps")
        plots["sweep_busy_gaps"] = out / "busy_gaps.png"
        fig.savefig(plots["sweep_busy_gaps"], dpi=110)
        plt.close(fig)
    waterfalls = {
        job["name"]: stepwise.load(path)
        for job in jobs
        if (path := Path(job["folder"]) / "waterfall" / "waterfall.json").exists()
    }
    if waterfalls:
        fig = waterfalls_figure(waterfalls)
        plots["sweep_waterfall"] = out / "waterfall.png"
        fig.savefig(plots["sweep_waterfall"], dpi=110)
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
        keys = swept(overrides)
        fixed = fixed_overrides(overrides)
        # The sweep's own params: what it varies and what it holds fixed (the jobs' whole configs
        # are their own runs' config.yaml).
        params = {f"sweep.{k}": ",".join(v) or "(generated)" for k, v in keys.items()}
        params |= {f"fixed.{key}": value for key, value in run_identity.chosen(fixed)}
        description = (
            f"Sweep over {' x '.join(keys) or 'one job'}"
            + "".join(f"; {k}: {', '.join(v)}" for k, v in keys.items() if v)
            + (f"; fixed: {' '.join(fixed)}" if fixed else "")
        )
        tags = {"sweep": "parent", "run_dir": str(sweep_dir.resolve())}
        # No sampler in the launcher: its thread would not pickle to joblib workers, and the
        # children sample their own machine.
        self.tracker.start(run_identity.parent_name(keys), tags, params, description, system_metrics=False)
        (sweep_dir / SWEEP_FILE).write_text(
            json.dumps({"parent_run_id": self.tracker.run_id, "overrides": overrides, "swept": keys})
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        keys = swept_keys(list(config.hydra.overrides.task))
        jobs = read_jobs(sweep_dir)
        FAILED_JOBS[:] = [
            f"{j['name']}: {j['failed_stage']}: {j['error']}" for j in jobs if j["status"] != "FINISHED"
        ]
        rows = job_rows(jobs, keys)
        metrics, tags = summary_metrics(rows)
        try:
            sections, plots = compare(sweep_dir, jobs, keys)
            md, page = write(
                sweep_dir / "report",
                "sweep",
                f"Sweep: {' '.join(config.hydra.overrides.task)}",
                sections,
                sweep_dir,
            )
            log.info("sweep: %d jobs, %d failed; comparison: %s", len(jobs), metrics["sweep/failed"], page)
        except Exception:  # the jobs' own results stand; a broken comparison must not hide them
            log.exception("the sweep comparison could not be written")
            plots = {}
        if self.tracker is None:
            return
        self.tracker.log_metrics(metrics)
        self.tracker.set_tags({"jobs": str(len(jobs)), "failed_jobs": str(metrics["sweep/failed"]), **tags})
        self.tracker.log_table(
            {
                "job": [r["job"] for r in rows],
                **{k: [r[k] for r in rows] for k in keys},
                "status": [r["status"] for r in rows],
                "decode_ms": [r["decode_ms"] for r in rows],
                "decode_p10_ms": [r["p10"] for r in rows],
                "decode_p90_ms": [r["p90"] for r in rows],
                "noisy": [r["noisy"] for r in rows],
            },
            "tables/jobs.json",
        )
        self.tracker.log_artifact(sweep_dir / "report")
        for key, path in plots.items():
            self.tracker.log_image(key, path)
        self.tracker.end("FINISHED")

"""Runs the stages in order: a line per stage with its time, MLflow logging, failure capture.

The one place the stages are run: `Runner(job).run()` for a whole run, and `new_state(job)` then
`advance(state, until)` for the bench and the tests, which bring a model to a named stage.

A stage that raises ends the job: its stage and a short cause go to the log, to MLflow (tags
`failed_stage`, `error`; status FAILED) and to `<run_dir>/logs/<stage>_traceback.txt`; everything
written so far stays. An interrupt ends the run KILLED.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable

from omegaconf import OmegaConf

from pipeline import parallel, run_identity
from pipeline.config import resolve_attention, resolve_backend
from pipeline.devices import dtype_name
from pipeline.errors import RunFailed, short_cause
from pipeline.faults import maybe_pause
from pipeline.models.zoo import takes_vision_states, text_config_of
from pipeline.parallel import Rank
from pipeline.report.run_report import headline, metrics_of
from pipeline.stages import capture, export, generate, load, numerics, profile, report, transforms
from pipeline.state import Job, RunState, StageRecord, StageResult
from pipeline.sweep import SUMMARY_FILE, this_sweep
from pipeline.tracking import Tracker, flatten_params

log = logging.getLogger(__name__)


# The order of the pipeline.
STAGES: list[tuple[str, Callable[[RunState], StageResult]]] = [
    ("load", load.run),
    ("export", export.run),
    ("transforms", transforms.run),
    ("capture", capture.run),
    ("numerics", numerics.run),
    ("generate", generate.run),
    ("profile", profile.run),
    ("report", report.run),
]


STAGE_NAMES = [name for name, _ in STAGES]


def new_state(job: Job, rank: Rank | None = None) -> RunState:
    """The state a job's stages start from: the job's config, folder, device (a rank's own GPU)
    and dtype, with backend=auto and attention=auto resolved for that device."""
    device = rank.device(job.device) if rank is not None else job.device
    (job.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    on_cuda = device.type == "cuda"
    return RunState(
        cfg=job.config,
        run_dir=job.run_dir,
        device=device,
        dtype=job.dtype,
        backend=resolve_backend(job.config, on_cuda, not takes_vision_states(job.hf_config)),
        attention=resolve_attention(job.config.attention.name, on_cuda),
        hf_config=job.hf_config,
        rank=rank,
    )


def run_stage(state: RunState, name: str) -> StageResult:
    """One stage on the state, recorded in state.stages with its time, notes, metrics and tags."""
    t0, started_ns = time.perf_counter(), time.time_ns()
    result = dict(STAGES)[name](state)
    seconds = time.perf_counter() - t0
    metrics = {f"stage/{name}_s": seconds, **result.metrics}
    state.stages.append(
        StageRecord(name, "done", seconds, result.notes, metrics, result.tags, started_ns=started_ns)
    )
    return result


def advance(state: RunState, until: str) -> RunState:
    """The stages after the last one the state has done, through `until`, without tracking or
    logging: how the bench and the tests bring a model to a stage. A stage that fails raises."""
    if until not in STAGE_NAMES:
        raise ValueError(f"no stage {until!r}; the stages are {', '.join(STAGE_NAMES)}")
    done = sum(1 for record in state.stages if record.status == "done")
    for name in STAGE_NAMES[done : STAGE_NAMES.index(until) + 1]:
        run_stage(state, name)
    return state


# At most this long rank 0 waits for another rank's summary.json before logging its folder
OTHER_RANKS_WAIT_S = 60.0


class Runner:
    """A whole run of a job: every stage in order, each logged and tracked, a failure recorded."""

    def __init__(self, job: Job, rank: Rank | None = None, parent_run_id: str | None = None):
        """rank: this process's place among tensor-parallel ranks (pipeline/ranks.py): rank 0 keeps
        the MLflow run, the others only their folder. parent_run_id: the sweep's MLflow run;
        default: the one Hydra's sweep callback opened (a spawned rank has no Hydra)."""
        cfg = job.config
        self.state = new_state(job, rank)
        self.name = job.name or run_identity.run_name(cfg, self.state.backend)
        self.overrides = list(job.overrides)
        self.rank = rank
        self.parent_run_id = parent_run_id if rank is not None else this_sweep().get("parent_run_id")
        tracked = cfg.tracking.enabled and (rank is None or rank.rank == 0)
        self.tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, job.run_dir, tracked)

    def _tags(self) -> dict[str, str]:
        cfg, state = self.state.cfg, self.state
        return {
            "model": cfg.model.name,
            "capture": cfg.capture.mode,
            "backend": cfg.backend.name,
            "attention": cfg.attention.name,
            "backend_resolved": state.backend,
            "attention_resolved": state.attention,
            "device": str(state.device),
            "dtype": dtype_name(state.dtype),
            "run_dir": str(state.run_dir.resolve()),
        }

    def _params(self) -> dict[str, str]:
        state = self.state
        layers = (
            getattr(text_config_of(state.hf_config), "num_hidden_layers", None) if state.hf_config else None
        )
        return run_identity.compared_params(
            state.cfg, backend=state.backend, attention=state.attention, dtype=state.dtype,
            device=state.device, text_layers=layers if layers is not None else "?", overrides=self.overrides,
            flat=flatten_params(state.cfg),
        )  # fmt: skip

    def run(self) -> RunState:
        state = self.state
        (state.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        tags = self._tags()
        if parent := self.parent_run_id:  # a job of a sweep: a child of its parent run
            tags["mlflow.parentRunId"] = parent
        params = self._params()
        self.tracker.start(self.name, tags, params, run_identity.description(params))
        self.tracker.log_dict(OmegaConf.to_container(OmegaConf.structured(state.cfg)), "config.yaml")
        self.tracker.log_artifact(state.run_dir / ".hydra")
        start = time.perf_counter()
        for name in STAGE_NAMES:
            log.info("[%s] ...", name)
            t0, started_ns = time.perf_counter(), time.time_ns()
            if self.rank is not None:
                parallel.write_progress(self.rank, name, self.tracker.run_id)
            try:
                maybe_pause(name)
                result = run_stage(state, name)
            except KeyboardInterrupt:
                self._ending()
                log.error(
                    "[%s] interrupted after %.1f s; the run is marked KILLED", name, time.perf_counter() - t0
                )
                state.stages.append(
                    StageRecord(
                        name, "killed", time.perf_counter() - t0, cause="interrupted", started_ns=started_ns
                    )
                )
                self._fail(name, "interrupted", status="KILLED")
                raise
            except Exception as exc:
                self._ending()
                cause = short_cause(exc)
                (state.run_dir / "logs" / f"{name}_traceback.txt").write_text(traceback.format_exc())
                log.error("[%s] FAILED after %.1f s: %s", name, time.perf_counter() - t0, cause)
                state.stages.append(
                    StageRecord(name, "failed", time.perf_counter() - t0, cause=cause, started_ns=started_ns)
                )
                self._fail(name, cause, status="FAILED")
                raise RunFailed(name, cause) from exc
            record = state.stages[-1]
            for note in record.notes:
                log.info("[%s] %s", name, note)
            log.info("[%s] done in %.1f s", name, record.seconds)
            self._log_result(record.metrics, result)
            if name == "transforms":
                self.tracker.log_params(
                    {"transforms": run_identity.transforms_param(state.transform_history)}
                )
        self.tracker.log_metrics({"stage/total_s": time.perf_counter() - start})
        self._log_other_ranks(wait_s=min(state.cfg.runtime.collective_timeout_s, OTHER_RANKS_WAIT_S))
        report_page = state.run_dir / "report" / "report.html"
        for line in headline(state, report_page if report_page.exists() else None):
            log.info("summary: %s", line)
        self._log_job_log()
        self._log_stage_spans()
        self.tracker.end("FINISHED")
        self._write_summary("FINISHED")
        return state

    def _log_result(self, metrics: dict[str, float], result: StageResult) -> None:
        tracker = self.tracker
        tracker.log_metrics(metrics)
        tracker.set_tags(result.tags)
        for key, values in result.steps.items():
            tracker.log_steps(key, values)
        for path in result.artifacts:
            tracker.log_artifact(path)
        for key, path in result.images.items():
            tracker.log_image(key, path)
        for artifact_file, columns in result.tables.items():
            tracker.log_table(columns, artifact_file)
        if result.workload:
            tracker.log_workload(result.workload, f"workload-{self.state.cfg.model.name}")

    def _log_stage_spans(self) -> None:
        """The stages as one MLflow trace (the run's Traces tab): a span each, with its status."""
        spans = [
            (
                r.name,
                r.started_ns,
                r.started_ns + int(r.seconds * 1e9),
                "OK" if r.status == "done" else "ERROR",
                {
                    "status": r.status,
                    "seconds": round(r.seconds, 3),
                    **({"cause": r.cause} if r.cause else {}),
                },
            )
            for r in self.state.stages
        ]
        self.tracker.log_spans(f"pipeline {self.name}", spans)

    def _ending(self) -> None:
        """A rank's run is ending badly: its record is written before any later signal is seen."""
        if self.rank is not None:
            parallel.stop_signals()

    def _log_other_ranks(self, wait_s: float = 0.0) -> None:
        """Rank 0's MLflow run holds every rank's folder (`rank<k>/`) and traces (traces/<phase>/
        rank<k>.json, written once the ranks met): one run per job. wait_s: how long to wait for a
        rank to end (its summary.json) before its folder is logged as it is; the ranks met in the
        report stage, so the others are writing their last files."""
        if self.rank is not None and self.rank.rank == 0:
            for other in range(1, self.rank.world):
                folder = parallel.rank_dir(self.state.run_dir, other)
                deadline = time.monotonic() + wait_s
                while not (folder / SUMMARY_FILE).exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                self.tracker.log_artifact(folder)
            self.tracker.log_artifact(self.state.run_dir / "traces")

    def _fail(self, stage: str, cause: str, status: str) -> None:
        self.tracker.set_tags({"failed_stage": stage, "error": cause})
        written = report.write_for_failure(self.state)
        # Whatever the stages wrote before the failure, and the report of it.
        for folder in ("logs", "export", "transforms", "generation", "profile", "traces"):
            self.tracker.log_artifact(self.state.run_dir / folder)
        for path in written:
            self.tracker.log_artifact(path)
        self._log_other_ranks()
        report_page = self.state.run_dir / "report" / "report.html" if written else None
        for line in headline(self.state, report_page):
            log.info("summary: %s", line)
        self._log_job_log()
        self._log_stage_spans()
        self.tracker.end(status)
        self._write_summary(status, stage, cause)

    def _write_summary(self, status: str, stage: str = "", cause: str = "") -> None:
        """summary.json in the run folder: what a sweep's comparison reads, with or without MLflow."""
        params = self._params()
        summary = {
            "name": self.tracker.run_name or self.name,
            "status": status,
            "failed_stage": stage,
            "error": cause,
            "run_id": self.tracker.run_id,
            "tags": self._tags() | self._result_tags(),
            "metrics": metrics_of(self.state),
            "overrides": self.overrides,
            "params": params,
            "description": run_identity.description(params),
        }
        (self.state.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))

    def _result_tags(self) -> dict[str, str]:
        return {k: v for record in self.state.stages for k, v in record.tags.items()}

    def _log_job_log(self) -> None:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.flush()
        self.tracker.log_artifact(self.state.run_dir / "pipeline.log")

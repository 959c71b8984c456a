"""Runs the stages in order: a line per stage with its time, MLflow logging, failure capture.

A stage that raises ends the job: its stage and a short cause go to the log, to MLflow (tags
`failed_stage`, `error`; status FAILED) and to `<run_dir>/logs/<stage>_traceback.txt`; everything
written so far stays. An interrupt ends the run KILLED.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.config import PipelineConfig, resolve_attention, resolve_backend
from pipeline.devices import dtype_name, resolve_device, resolve_dtype
from pipeline.errors import RunFailed, short_cause
from pipeline.faults import maybe_pause
from pipeline.report.run_report import headline, metrics_of
from pipeline.stages import capture, export, generate, load, profile, report, transforms
from pipeline.state import RunState, StageRecord, StageResult
from pipeline.sweep import SUMMARY_FILE, SWEEP_PARENT_ENV
from pipeline.tracking import Tracker, flatten_params, git_commit

log = logging.getLogger(__name__)


# The order of the pipeline.
STAGES: list[tuple[str, Callable[[RunState], StageResult]]] = [
    ("load", load.run),
    ("export", export.run),
    ("transforms", transforms.run),
    ("capture", capture.run),
    ("generate", generate.run),
    ("profile", profile.run),
    ("report", report.run),
]


def run_name(cfg: PipelineConfig) -> str:
    return f"{cfg.model.name}-{cfg.capture.mode}-{cfg.backend.name}"


class Runner:
    def __init__(
        self,
        cfg: PipelineConfig,
        run_dir: Path,
        hf_config,
        name: str | None = None,
        dtype: torch.dtype | None = None,
    ):
        """name: the MLflow run name (a sweep passes its swept values); default from the config.
        dtype: as resolved before loading (dtype=auto may pick bfloat16 to fit); default from cfg."""
        self.name = name or run_name(cfg)
        device = resolve_device(cfg.device)
        self.state = RunState(
            cfg=cfg,
            run_dir=run_dir,
            device=device,
            dtype=dtype or resolve_dtype(cfg.dtype, device),
            backend=resolve_backend(cfg, device.type == "cuda"),
            attention=resolve_attention(cfg.attention.name, device.type == "cuda"),
            hf_config=hf_config,
        )
        self.tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment, run_dir, cfg.tracking.enabled)

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
            "git_commit": git_commit(),
            "run_dir": str(state.run_dir.resolve()),
        }

    def run(self) -> RunState:
        state = self.state
        (state.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        tags = self._tags()
        if parent := os.environ.get(SWEEP_PARENT_ENV):  # a job of a sweep: a child of its parent run
            tags["mlflow.parentRunId"] = parent
        self.tracker.start(self.name, tags, flatten_params(state.cfg))
        self.tracker.log_artifact(state.run_dir / ".hydra")
        start = time.perf_counter()
        for name, stage in STAGES:
            log.info("[%s] ...", name)
            t0 = time.perf_counter()
            try:
                maybe_pause(name)
                result = stage(state)
            except KeyboardInterrupt:
                log.error(
                    "[%s] interrupted after %.1f s; the run is marked KILLED", name, time.perf_counter() - t0
                )
                state.stages.append(
                    StageRecord(name, "killed", time.perf_counter() - t0, cause="interrupted")
                )
                self._fail(name, "interrupted", status="KILLED")
                raise
            except Exception as exc:
                cause = short_cause(exc)
                (state.run_dir / "logs" / f"{name}_traceback.txt").write_text(traceback.format_exc())
                log.error("[%s] FAILED after %.1f s: %s", name, time.perf_counter() - t0, cause)
                state.stages.append(StageRecord(name, "failed", time.perf_counter() - t0, cause=cause))
                self._fail(name, cause, status="FAILED")
                raise RunFailed(name, cause) from exc
            seconds = time.perf_counter() - t0
            state.stages.append(
                StageRecord(
                    name,
                    "done",
                    seconds,
                    result.notes,
                    {f"time/{name}_s": seconds, **result.metrics},
                    result.tags,
                )
            )
            for note in result.notes:
                log.info("[%s] %s", name, note)
            log.info("[%s] done in %.1f s", name, seconds)
            self.tracker.log_metrics({f"time/{name}_s": seconds, **result.metrics})
            self.tracker.set_tags(result.tags)
            for path in result.artifacts:
                self.tracker.log_artifact(path)
            for key, path in result.images.items():
                self.tracker.log_image(key, path)
        self.tracker.log_metrics({"time/total_s": time.perf_counter() - start})
        for line in headline(state, state.run_dir / "report" / "report.html"):
            log.info("summary: %s", line)
        self._log_job_log()
        self.tracker.end("FINISHED")
        self._write_summary("FINISHED")
        return state

    def _fail(self, stage: str, cause: str, status: str) -> None:
        self.tracker.set_tags({"failed_stage": stage, "error": cause})
        written = report.write_for_failure(self.state)
        # Whatever the stages wrote before the failure, and the report of it.
        for folder in ("logs", "export", "transforms", "generation", "profile", "traces"):
            self.tracker.log_artifact(self.state.run_dir / folder)
        for path in written:
            self.tracker.log_artifact(path)
        report_page = self.state.run_dir / "report" / "report.html" if written else None
        for line in headline(self.state, report_page):
            log.info("summary: %s", line)
        self._log_job_log()
        self.tracker.end(status)
        self._write_summary(status, stage, cause)

    def _write_summary(self, status: str, stage: str = "", cause: str = "") -> None:
        """summary.json in the run folder: what a sweep's comparison reads, with or without MLflow."""
        summary = {
            "name": self.name,
            "status": status,
            "failed_stage": stage,
            "error": cause,
            "run_id": self.tracker.run_id,
            "tags": self._tags(),
            "metrics": metrics_of(self.state),
        }
        (self.state.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))

    def _log_job_log(self) -> None:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.flush()
        self.tracker.log_artifact(self.state.run_dir / "pipeline.log")

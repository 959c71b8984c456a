"""Sweeps: one parent MLflow run, a child per job named by its swept values, failed jobs kept
with their stage and cause, a comparison at the end; parallel jobs with the joblib launcher."""

from __future__ import annotations

import pytest
from conftest import mlflow_runs, run_pipeline

from pipeline.sweep import swept_keys

pytestmark = pytest.mark.slow


def test_swept_keys_are_the_ones_with_choices():
    overrides = ["model=tiny_mistral3", "capture=none,full", "seed=range(3)", "+profile.x=1", "backend=a,b"]
    assert swept_keys(overrides) == ["capture", "seed", "backend"]


def _children(runs, parent):
    return [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


def test_sweep_parent_children_and_comparison(tmp_path, tracking_uri):
    proc = run_pipeline(
        [
            "-m",
            "model=tiny_mistral3",
            "capture=none,full,partial",
            "backend=torch-simple",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # one job failed; the others and the comparison ran
    assert "sweep: 1 job(s) failed: capture=full: export:" in proc.stderr
    client, runs = mlflow_runs(tracking_uri)
    parent = next(r for r in runs if r.data.tags.get("sweep") == "parent")
    assert parent.info.status == "FINISHED" and parent.data.tags["failed_jobs"] == "1"
    assert "capture=none,full,partial" in parent.data.params["sweep.overrides"]
    children = _children(runs, parent)
    status = {r.info.run_name: r.info.status for r in children}
    assert status == {"capture=none": "FINISHED", "capture=full": "FAILED", "capture=partial": "FINISHED"}
    failed = next(r for r in children if r.info.status == "FAILED")
    assert failed.data.tags["failed_stage"] == "export"

    report = tmp_path / "multirun" / "report"
    html = (report / "sweep.html").read_text()
    assert html.count("<tr>") == 4 and "FAILED" in html and "vision_tower" in html
    assert (report / "decode_ms.png").exists() and (report / "module_breakdown.png").exists()
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/sweep.html" in artifacts


def test_parallel_jobs_with_joblib_share_the_sqlite_store(tmp_path, tracking_uri):
    proc = run_pipeline(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "model=tiny_llama3_1_8b",
            "capture=none,partial",
            "backend=torch-simple,torch-compile",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, runs = mlflow_runs(tracking_uri)
    parent = next(r for r in runs if r.data.tags.get("sweep") == "parent")
    children = _children(runs, parent)
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    assert all(
        "latency/decode_ms" in r.data.metrics and "profile/coverage_pct" in r.data.metrics for r in children
    )

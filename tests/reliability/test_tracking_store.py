"""The tracking store failing under a run (unreachable, or its artifacts cannot be written), the
upload of such a run later, concurrent sweeps against the embedded store and a local server, and
what the project exposes (localhost only, no remote code, safetensors only)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO_ROOT, mlflow_runs, mlflow_server, run_pipeline

from pipeline.config import ModelConfig
from pipeline.tools.sync import main as sync

pytestmark = pytest.mark.slow

LIGHT = [
    "model=tiny_llama3_1_8b",
    "prompt.output_len=4",
    "profile.decode_steps=2",
    "profile.kernel_provenance=false",
]


def test_an_artifact_store_that_cannot_be_written_keeps_the_run_local_then_sync(tmp_path, tracking_uri):
    (tmp_path / "mlartifacts").write_text("a file where the artifact folder should be")  # like a full disk
    proc = run_pipeline([*LIGHT, f"tracking.uri={tracking_uri}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = tmp_path / "run"
    offline = (run_dir / "tracking_offline.txt").read_text()
    assert "Not logged" in offline and "pipeline.tools.sync" in offline
    assert (run_dir / "report" / "report.html").exists() and (run_dir / "summary.json").exists()
    _, runs = mlflow_runs(tracking_uri)
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["tracking"].startswith("incomplete")

    target = f"sqlite:///{tmp_path / 'later' / 'mlflow.db'}"
    (tmp_path / "later").mkdir()
    assert sync([str(run_dir), "--tracking-uri", target]) == 0
    client, runs = mlflow_runs(target)
    synced = runs[0]
    assert synced.info.status == "FINISHED" and synced.data.metrics["latency/decode_ms"] > 0
    assert {"report", "profile", "summary.json"} <= {
        a.path for a in client.list_artifacts(synced.info.run_id)
    }
    assert sync([str(tmp_path)]) == 2  # not a run folder


def test_a_locked_sqlite_store_leaves_the_run_local(tmp_path, tracking_uri):
    import sqlite3

    run_pipeline(
        ["model=tiny_llama3_1_8b", "dry_run=true", f"tracking.uri={tracking_uri}"], tmp_path / "init"
    )
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).search_experiments()  # the schema exists
    lock = sqlite3.connect(tmp_path / "mlflow.db", timeout=1)
    lock.execute("BEGIN EXCLUSIVE")  # another process holds the database
    try:
        proc = run_pipeline([*LIGHT, f"tracking.uri={tracking_uri}"], tmp_path, timeout=600)
    finally:
        lock.rollback()
        lock.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "locked" in (tmp_path / "run" / "tracking_offline.txt").read_text()
    assert (tmp_path / "run" / "summary.json").exists() and (
        tmp_path / "run" / "report" / "report.html"
    ).exists()


def _sweep(tmp_path, uri: str) -> subprocess.CompletedProcess:
    return run_pipeline(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "model=tiny_llama3_1_8b",
            "capture=none",
            "backend=torch-simple",
            "seed=range(4)",
            "prompt.output_len=2",
            "profile.enabled=false",
            "report.enabled=false",
            f"tracking.uri={uri}",
        ],  # fmt: skip
        tmp_path,
    )


def _check_sweep(uri: str, parents: int) -> None:
    client, runs = mlflow_runs(uri)
    parent_runs = [r for r in runs if r.data.tags.get("sweep") == "parent"]
    assert len(parent_runs) == parents and all(r.info.status == "FINISHED" for r in parent_runs)
    for parent in parent_runs:
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
        assert all(
            "latency/decode_ms" in r.data.metrics and "stage/total_s" in r.data.metrics for r in children
        )
        assert all(client.list_artifacts(r.info.run_id, "generation") for r in children)


# Once is a test; `make soak` repeats it (PIPELINE_SOAK_REPEATS) to hunt a race.
@pytest.mark.parametrize("repeat", range(int(os.environ.get("PIPELINE_SOAK_REPEATS", "1"))))
def test_parallel_sweeps_lose_no_run_in_the_embedded_store(repeat, tmp_path, tracking_uri):
    proc = _sweep(tmp_path, tracking_uri)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _check_sweep(tracking_uri, parents=1)


def test_parallel_sweep_against_a_local_server(tmp_path):
    store = f"sqlite:///{tmp_path / 'server.db'}"
    with mlflow_server(store, "--default-artifact-root", str(tmp_path / "artifacts")) as uri:
        proc = _sweep(tmp_path, uri)
        assert proc.returncode == 0, proc.stderr[-2000:]
        _check_sweep(uri, parents=1)


def test_what_the_project_exposes():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "--host 127.0.0.1" in makefile and "0.0.0.0" not in makefile
    assert ModelConfig().trust_remote_code is False
    build = (REPO_ROOT / "pipeline" / "models" / "checkpoint.py").read_text()
    assert "use_safetensors=True" in build and "torch.load" not in build

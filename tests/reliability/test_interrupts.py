"""Interrupts: SIGINT and SIGTERM in the middle of a stage end the run KILLED (never RUNNING
forever), keep what was written, log where it stopped and exit promptly; a SIGKILL leaves a RUNNING
run that the next invocation finds (by host and pid) and marks FAILED."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from conftest import mlflow_runs, run_pipeline, start_paused

pytestmark = pytest.mark.slow

ARGS = ["model=tiny_llama3_1_8b", "backend=torch-compile", "prompt.output_len=4", "profile.decode_steps=2"]


def _start_paused(stage: str, tmp_path, uri: str) -> subprocess.Popen:
    return start_paused(stage, [*ARGS, f"tracking.uri={uri}"], tmp_path / "run")


def _wait_for_stage(proc: subprocess.Popen, log, stage: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and f"[{stage}] ..." in log.read_text()):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"never reached {stage}"
        time.sleep(0.2)
    time.sleep(0.5)  # inside the stage's pause


@pytest.mark.parametrize(
    ("stage", "signum", "kept"),
    [
        ("load", signal.SIGINT, []),
        ("export", signal.SIGTERM, []),
        ("capture", signal.SIGINT, ["export", "transforms"]),
        ("profile", signal.SIGTERM, ["export", "transforms", "generation"]),
    ],
)
def test_interrupt_ends_the_run_killed_and_keeps_its_files(stage, signum, kept, tmp_path, tracking_uri):
    proc = _start_paused(stage, tmp_path, tracking_uri)
    log = tmp_path / "run" / "pipeline.log"
    _wait_for_stage(proc, log, stage)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=90)  # liveness: seconds here, 90 s on any host
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr
    _, runs = mlflow_runs(tracking_uri)
    assert runs[0].info.status == "KILLED" and runs[0].data.tags["failed_stage"] == stage
    assert f"[{stage}] interrupted" in log.read_text()
    for folder in kept:
        assert any((tmp_path / "run" / folder).iterdir()), folder
    assert (tmp_path / "run" / "report" / "report.md").exists()


def test_a_killed_run_is_marked_failed_by_the_next_invocation(tmp_path, tracking_uri):
    proc = _start_paused("generate", tmp_path / "first", tracking_uri)
    _wait_for_stage(proc, tmp_path / "first" / "run" / "pipeline.log", "generate")
    proc.kill()
    proc.communicate(timeout=30)  # reaped: its pid no longer names a process
    _, runs = mlflow_runs(tracking_uri)
    assert runs[0].info.status == "RUNNING"
    killed = runs[0].info.run_id

    second = run_pipeline(
        [*ARGS, "backend=torch-simple", f"tracking.uri={tracking_uri}"], tmp_path / "second"
    )
    assert second.returncode == 0, second.stderr[-2000:]
    client, _ = mlflow_runs(tracking_uri)
    run = client.get_run(killed)
    assert run.info.status == "FAILED" and "ended without closing the run" in run.data.tags["error"]

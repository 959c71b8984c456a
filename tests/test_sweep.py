"""Sweeps: one parent MLflow run, a child per job named by its swept values, failed jobs kept
with their stage and cause, a comparison at the end; parallel jobs with the joblib launcher."""

from __future__ import annotations

import pytest
from conftest import child_runs, mlflow_runs, run_pipeline, sweep_parent

from pipeline.sweep import decode_figure, job_rows, summary_metrics, swept_keys


def test_swept_keys_are_the_ones_with_choices():
    overrides = ["model=tiny_mistral3", "capture=none,full", "seed=range(3)", "+profile.x=1", "backend=a,b"]
    assert swept_keys(overrides) == ["capture", "seed", "backend"]


def _job(name, model, capture, status="FINISHED", decode=None, noisy="false"):
    metrics = {} if decode is None else {
        "latency/decode_ms": decode, "latency/decode_p10_ms": 0.9 * decode, "latency/decode_p90_ms": 1.2 * decode
    }  # fmt: skip
    return {
        "name": name, "status": status, "failed_stage": "" if status == "FINISHED" else "export",
        "error": "", "tags": {"noisy": noisy}, "metrics": metrics,
        "overrides": [f"model={model}", f"capture={capture}", "prompt.output_len=4"],
    }  # fmt: skip


def test_decode_plot_has_a_panel_per_model_and_draws_failed_jobs_as_failed():
    """The issue's case: a 23.5 ms model and a 1.18 ms one are never averaged, and a failed job
    is a hatched bar marked FAILED, not a 0 ms bar."""
    jobs = [
        _job("mistral3·none", "mistral3", "none", decode=30.0),
        _job("mistral3·part", "mistral3", "partial", decode=23.5, noisy="true"),
        _job("qwen3·none", "tiny_qwen3", "none", decode=2.0),
        _job("qwen3·part", "tiny_qwen3", "partial", status="FAILED"),
    ]
    keys = ["model", "capture"]
    rows = job_rows(jobs, keys)
    fig = decode_figure(rows, keys)
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [
        "model=mistral3: 2 of 2 finished",
        "model=tiny_qwen3: 1 of 2 finished",
    ]
    assert "4 jobs (1 failed, drawn hatched)" in fig._suptitle.get_text()
    heights = [sorted(round(p.get_height(), 3) for p in ax.patches if p.get_fill()) for ax in axes]
    assert heights == [[23.5, 30.0], [2.0]]  # nothing averaged across models, no 0 bar
    hatched = [p for p in axes[1].patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_height() > 2.0  # across the panel, not at 0
    texts = [t.get_text() for t in axes[1].texts]
    assert "FAILED\nexport" in texts
    assert any("noisy" in t.get_text() for t in axes[0].texts)
    metrics, tags = summary_metrics(rows)
    assert metrics == {"sweep/jobs": 4, "sweep/failed": 1, "sweep/noisy": 1, "sweep/best_decode_ms": 2.0,
                       "sweep/worst_decode_ms": 30.0}  # fmt: skip
    assert tags == {"best_job": "qwen3·none", "worst_job": "mistral3·none"}


@pytest.mark.slow
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
    assert "sweep: 1 job(s) failed: full: export:" in proc.stderr
    client, runs = mlflow_runs(tracking_uri)
    parent = sweep_parent(runs)
    assert parent.info.status == "FINISHED" and parent.data.tags["failed_jobs"] == "1"
    assert parent.info.run_name == "sweep·capture"
    assert parent.data.params == {
        "sweep.capture": "none,full,partial",
        "fixed.model": "tiny_mistral3",
        "fixed.backend": "torch-simple",
        "fixed.prompt.output_len": "4",
        "fixed.profile.decode_steps": "2",
    }  # where the runs are stored is no param
    assert parent.data.metrics["sweep/jobs"] == 3 and parent.data.metrics["sweep/failed"] == 1
    assert parent.data.metrics["sweep/best_decode_ms"] <= parent.data.metrics["sweep/worst_decode_ms"]
    assert parent.data.tags["best_job"] in ("eager", "partial")
    children = child_runs(runs, parent)
    status = {r.info.run_name: r.info.status for r in children}
    assert status == {"eager": "FINISHED", "full": "FAILED", "partial": "FINISHED"}
    failed = next(r for r in children if r.info.status == "FAILED")
    assert failed.data.tags["failed_stage"] == "export"
    assert "transforms" not in failed.data.params  # it failed before any transform ran
    partial = next(r for r in children if r.info.run_name == "partial")
    assert partial.data.params["capture"] == "partial" and "fixed.tracking.uri" not in partial.data.params

    report = tmp_path / "multirun" / "report"
    html = (report / "sweep.html").read_text()
    assert html.count("<tr>") == 4 and "FAILED" in html and "vision_tower" in html
    assert (report / "decode_ms.png").exists() and (report / "module_breakdown.png").exists()
    assert (report / "busy_gaps.png").exists()
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/sweep.html" in artifacts


@pytest.mark.slow
def test_parallel_jobs_with_joblib_share_the_sqlite_store(tmp_path, tracking_uri):
    proc = run_pipeline(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "model=tiny_llama3_1_8b",
            "capture=none,partial",
            "backend=torch-simple",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, runs = mlflow_runs(tracking_uri)
    parent = sweep_parent(runs)
    children = child_runs(runs, parent)
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    assert all(
        "latency/decode_ms" in r.data.metrics and "profile/coverage_pct" in r.data.metrics for r in children
    )


@pytest.mark.slow
@pytest.mark.timeout(600)  # ray_local's sweep took 60-120 s on 2 cores
@pytest.mark.parametrize("launcher", ["local", "ray_local"])
def test_cluster_launchers_run_jobs_in_their_own_processes(launcher, tmp_path, tracking_uri):
    """hydra/launcher=local: hydra-submitit-launcher's local executor, the SLURM launcher's code
    path; hydra/launcher=ray_local: hydra-ray-launcher on a Ray started here, a Ray cluster's code
    path. Each job a process of its own, the config re-composed there, results sent back pickled."""
    proc = run_pipeline(
        [
            "-m",
            f"hydra/launcher={launcher}",
            "model=tiny_mistral3,tiny_llama3_1_8b",
            "capture=full",  # two jobs: mistral3's fails at export, llama's runs
            "backend=torch-simple",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # tiny_mistral3's vision tower cannot be exported
    assert "sweep: 1 job(s) failed:" in proc.stderr and ": export:" in proc.stderr
    _, runs = mlflow_runs(tracking_uri)
    parent = sweep_parent(runs)
    assert parent.data.metrics["sweep/jobs"] == 2 and parent.data.metrics["sweep/failed"] == 1
    children = child_runs(runs, parent)
    status = sorted((r.info.run_name, r.info.status) for r in children)
    assert [s for _, s in status] == ["FINISHED", "FAILED"], status
    assert status[1][0].startswith("mistral3")
    assert all("latency/decode_ms" in r.data.metrics for r in children if r.info.status == "FINISHED")
    if launcher == "local":  # each job ran in a process of its own, with submitit's logs beside it
        assert len(list((tmp_path / "multirun" / ".submitit").glob("*/*_log.out"))) == 2
    else:  # in Ray's worker processes, which name the task and their pid before every line they pass on
        assert "(_run_job pid=" in proc.stderr, proc.stderr[-2000:]
    assert (tmp_path / "multirun" / "report" / "sweep.html").exists()


@pytest.mark.slow
def test_a_sweep_parent_shows_each_jobs_waterfall(tmp_path, tracking_uri):
    """profile.waterfall=true over two models: the parent's report and MLflow images hold one
    plot of both jobs' waterfalls, each relative to its own eager step."""
    proc = run_pipeline(
        [
            "-m",
            "model=tiny_llama3_1_8b,tiny_qwen3",
            "profile.waterfall=true",
            "backend=torch-simple",
            "prompt.output_len=4",
            "profile.decode_steps=2",
            "profile.reference=none",
            f"tracking.uri={tracking_uri}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = tmp_path / "multirun" / "report"
    assert (report / "waterfall.png").stat().st_size > 0
    assert "waterfall" in (report / "sweep.html").read_text()
    client, runs = mlflow_runs(tracking_uri)
    parent = sweep_parent(runs)
    images = {a.path for a in client.list_artifacts(parent.info.run_id, "images")}
    assert any("sweep_waterfall" in path for path in images), images
    for child in child_runs(runs, parent):
        assert child.data.metrics["waterfall/decode/00_eager_ms"] > 0

"""The cluster launchers' settings (pipeline/launchers.py, conf/hydra/launcher/): a job's memory
from its model's estimate, and a tracking store the jobs can share, checked before any job."""

from __future__ import annotations

import pytest
import torch
from conftest import run_pipeline
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline import launchers
from pipeline.config import RuntimeConfig


def _launcher(*overrides: str):
    with initialize_config_dir(str(launchers.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return cfg


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_job_memory_is_the_largest_swept_models_estimate(launcher):
    cfg = _launcher(f"hydra/launcher={launcher}", "model=tiny_mistral3")
    # compose() leaves hydra.overrides.task as the overrides given; a sweep's would hold model=a,b
    OmegaConf.update(cfg, "hydra.overrides.task", ["model=mistral3,llama3_1_8b"], force_add=True)
    mem_gb = cfg.hydra.launcher.mem_gb
    runtime = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RuntimeConfig), cfg.runtime))
    mistral3 = launchers.model_gb("mistral3", runtime, torch.bfloat16)
    # the estimate from the seed's published config (2.89 B parameters in this config): bf16 weights
    assert 2.89e9 * 2 / 1e9 < mistral3 < mem_gb == int(mistral3 + 0.999) + launchers.PROCESS_GB
    assert launchers.model_gb("llama3_1_8b", runtime, torch.bfloat16) < mistral3


def test_unswept_model_sizes_the_job():
    cfg = _launcher("hydra/launcher=local", "model=tiny_llama3_1_8b")
    assert cfg.hydra.launcher.mem_gb == 1 + launchers.PROCESS_GB


def test_slurm_refuses_a_sqlite_store_before_any_job(monkeypatch):
    monkeypatch.setattr(launchers.shutil, "which", lambda name: f"/usr/bin/{name}")  # as on a cluster
    error = launchers.cluster_launch_problem(["hydra/launcher=slurm", "model=tiny_mistral3"])
    assert (
        error.startswith("tracking.uri=(the local SQLite store) cannot be shared")
        and "mlflow server" in error
    )
    assert launchers.cluster_launch_problem(["hydra/launcher=slurm", "tracking.uri=http://head:5000"]) is None
    assert launchers.cluster_launch_problem(["hydra/launcher=local"]) is None


def test_ray_tasks_ask_for_a_gpu_and_the_same_memory_in_bytes():
    remote = _launcher("hydra/launcher=ray_cluster", "model=tiny_llama3_1_8b").hydra.launcher.ray.remote
    assert remote.memory == (1 + launchers.PROCESS_GB) * 10**9
    assert remote.num_gpus == 1 and remote.max_retries == 0


def test_ray_needs_a_running_cluster_and_a_shared_store(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launchers.tempfile, "gettempdir", lambda: str(tmp_path))  # no `ray start` here
    error = launchers.cluster_launch_problem(["hydra/launcher=ray_cluster", "tracking.uri=http://head:5000"])
    assert error.startswith("hydra/launcher=ray_cluster needs a running Ray cluster") and "ray_local" in error
    given = ["hydra/launcher=ray_cluster", "hydra.launcher.ray.init.address=head:6379"]
    assert "cannot be shared by hydra/launcher=ray_cluster" in launchers.cluster_launch_problem(given)
    assert launchers.cluster_launch_problem([*given, "tracking.uri=http://head:5000"]) is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6379")  # what `ray start` leaves
    assert (
        launchers.cluster_launch_problem(["hydra/launcher=ray_cluster", "tracking.uri=http://head:5000"])
        is None
    )
    assert launchers.cluster_launch_problem(["hydra/launcher=ray_local"]) is None


def test_slurm_without_slurm_is_a_config_error(tmp_path):
    proc = run_pipeline(
        ["-m", "hydra/launcher=slurm", "model=tiny_mistral3", "capture=none,partial"], tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: hydra/launcher=slurm needs SLURM (no sbatch on PATH here)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "multirun").exists()

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
    error = launchers.unshared_tracking(["hydra/launcher=slurm", "model=tiny_mistral3"])
    assert (
        error.startswith("tracking.uri=(the local SQLite store) cannot be shared")
        and "mlflow server" in error
    )
    assert launchers.unshared_tracking(["hydra/launcher=slurm", "tracking.uri=http://head:5000"]) is None
    assert launchers.unshared_tracking(["hydra/launcher=local"]) is None


def test_slurm_without_slurm_is_a_config_error(tmp_path):
    proc = run_pipeline(
        ["-m", "hydra/launcher=slurm", "model=tiny_mistral3", "capture=none,partial"], tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "config error: hydra/launcher=slurm needs SLURM (no sbatch on PATH here)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "multirun").exists()

"""What a sweep's cluster jobs ask the scheduler for (conf/hydra/launcher/*.yaml): the host memory
of a job from its model's estimate, as the `pipeline.job_mem_gb` resolver, and the checks a
cluster launcher needs before any job is submitted.

The launcher's settings are resolved once, in the launcher process, for every job of the sweep, so
the memory is that of the largest model the sweep names (`model=a,b` among its overrides)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.config import ModelConfig, RuntimeConfig
from pipeline.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Python, torch, transformers, MLflow and the profiler beside the weights: a tiny model's CPU run
# peaks under 1 GB resident (/usr/bin/time); a CUDA process's context and kernel images add a few
# GB more
PROCESS_GB = 4
SLURM_LAUNCHERS = ("slurm", "submitit_slurm")
CLUSTER_LAUNCHERS = (*SLURM_LAUNCHERS, "ray_cluster")  # jobs on other machines: the store must be shared


def swept_models(root: DictConfig) -> list[str]:
    """The model names a sweep runs: the values of its `model=` override, else the config's model."""
    for override in root.hydra.overrides.task:
        key, _, value = str(override).partition("=")
        if key.lstrip("+~") == "model":
            return [v.strip() for v in value.removeprefix("choice(").removesuffix(")").split(",")]
    return [str(root.model.name)]


def model_gb(name: str, runtime: RuntimeConfig, dtype) -> float:
    """A model's weights at `dtype` and its default KV cache, with the load check's headroom
    (models/memory.py), from its conf/model file; parameters counted on the meta device."""
    from pipeline.models import memory, meta, zoo

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"model={name}: no conf/model/{name}.yaml to size the sweep's jobs from")
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    hf_config = zoo.build_hf_config(model_cfg)
    skeleton = meta.meta_model(zoo.resolve_model_class(model_cfg, hf_config), hf_config)
    params = meta.parameter_count(skeleton)
    return memory.needed_bytes(params, hf_config, runtime, dtype) / 1e9


def job_mem_gb(*, _root_: DictConfig) -> int:
    """Host memory a job of this sweep asks for, in GB: the largest swept model in bfloat16 (what a
    GPU job runs) plus the process itself. On a GPU node the weights go to the device, but a
    checkpoint passes through host memory on the way."""
    import torch

    runtime = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RuntimeConfig), _root_.runtime))
    largest = max(model_gb(name, runtime, torch.bfloat16) for name in swept_models(_root_))
    return math.ceil(largest) + PROCESS_GB


def job_mem_bytes(*, _root_: DictConfig) -> int:
    """job_mem_gb in bytes: what Ray's `memory` resource counts."""
    return job_mem_gb(_root_=_root_) * 10**9


# at import: pipeline.__main__ imports this module, in the launcher process that resolves
# hydra.launcher and in a job's process (submitit and Ray unpickle __main__'s job function there)
# that re-composes the sweep's config
OmegaConf.register_new_resolver("pipeline.job_mem_gb", job_mem_gb, replace=True)
OmegaConf.register_new_resolver("pipeline.job_mem_bytes", job_mem_bytes, replace=True)


def cluster_launch_problem(overrides: list[str]) -> str | None:
    """What stops a cluster launcher before any job is submitted, in one line: no scheduler to
    submit to, or a tracking store the jobs cannot share (jobs on other machines cannot write the
    launcher's SQLite file, nor should several hosts share one on a network file system: its locks
    do not hold there). Read off the command line, before Hydra composes anything: Hydra turns a
    callback's exception into a warning."""
    given = {o.partition("=")[0].lstrip("+~"): o.partition("=")[2] for o in overrides}
    launcher = given.get("hydra/launcher")
    if launcher not in CLUSTER_LAUNCHERS:
        return None
    if launcher in SLURM_LAUNCHERS and shutil.which("sbatch") is None:
        # submitit would fail later with a traceback ("srun")
        return (
            f"hydra/launcher={launcher} needs SLURM (no sbatch on PATH here); "
            "hydra/launcher=local runs the same jobs on this machine"
        )
    if launcher == "ray_cluster" and not _ray_cluster_known(given):
        # ray.init(address="auto") would fail later with a traceback
        return (
            "hydra/launcher=ray_cluster needs a running Ray cluster (`ray start --head` here, or its address in "
            "RAY_ADDRESS or hydra.launcher.ray.init.address=<head>:6379); hydra/launcher=ray_local "
            "starts one on this machine"
        )
    if given.get("tracking.enabled") == "false":
        return None
    uri = given.get("tracking.uri", "")
    if uri.startswith(("http://", "https://")):
        return None
    return (
        f"tracking.uri={uri or '(the local SQLite store)'} cannot be shared by hydra/launcher="
        f"{given['hydra/launcher']} jobs on other machines: start `mlflow server` on one host and pass "
        "tracking.uri=http://<host>:5000"
    )


def _ray_cluster_known(given: dict[str, str]) -> bool:
    """An address on the command line or in RAY_ADDRESS, or the file `ray start` leaves in Ray's
    temporary folder for ray.init(address="auto") to find."""
    if given.get("hydra.launcher.ray.init.address", "auto") not in ("auto", "") or os.environ.get(
        "RAY_ADDRESS"
    ):
        return True
    return Path(tempfile.gettempdir(), "ray", "ray_current_cluster").exists()

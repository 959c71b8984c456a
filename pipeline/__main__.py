"""`python -m pipeline [overrides]`: compose, validate, run the stages.

Exit codes: 0 done, 1 a run failed (its MLflow run is FAILED), 2 a config mistake (nothing built,
no MLflow run). Errors are printed as one line; tracebacks of failed stages are in the run folder.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import launchers, ranks, sweep
from pipeline.config import register_schemas, typed
from pipeline.devices import free_memory
from pipeline.errors import ConfigError, RunFailed
from pipeline.jobs import check_config, checked_job
from pipeline.runtime.host_memory import give_back_freed_memory
from pipeline.sweep import record_job_failure

log = logging.getLogger("pipeline")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def job(cfg: DictConfig) -> None:
    """One Hydra job. In a single run, errors end the process here with their one line and exit
    code. In a multirun a failed job is recorded (its summary.json) and the sweep goes on to the
    next job and, at the end, to the comparison; the process then exits 1 if any job failed."""
    multirun = _multirun()
    try:
        _job(cfg)
    except (ConfigError, RunFailed) as exc:
        if multirun:
            log.error("job failed: %s", exc)
            _record_failure(cfg, exc)
            return
        print(f"{'config error' if isinstance(exc, ConfigError) else 'run failed'}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Exception as exc:
        if not multirun:
            raise
        log.exception("job failed")
        _record_failure(cfg, exc)
    finally:
        if multirun:  # sweep jobs share one process (basic launcher): the next job's memory check
            free_memory()  # must see the memory this job's model held,
            give_back_freed_memory()  # and the host memory a CPU job kept (runtime/host_memory.py)


def _multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _job_name(hydra_cfg) -> str | None:
    """A sweep's job is named by the values it sweeps, so children read apart in the MLflow UI."""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    keys = sweep.this_sweep().get("swept", {})
    return sweep.job_name(list(hydra_cfg.overrides.task), keys) or hydra_cfg.job.override_dirname or None


def _record_failure(cfg: DictConfig, exc: BaseException) -> None:
    hydra_cfg = HydraConfig.get()
    folder = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    record_job_failure(cfg, folder, _job_name(hydra_cfg) or folder.name, exc, overrides)


def _job(cfg: DictConfig) -> None:
    if typed(cfg).dry_run:
        check_config(cfg, _cuda_available(), _multirun())
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return
    from pipeline.runner import Runner

    hydra_cfg = HydraConfig.get()
    job = checked_job(
        cfg,
        Path(hydra_cfg.runtime.output_dir),
        _cuda_available(),
        _job_name(hydra_cfg),
        tuple(hydra_cfg.overrides.task),
        _multirun(),
    )
    config = job.config
    if config.runtime.world_size > 1 and ranks.torchrun_world():
        ranks.run_under_torchrun(job)
    elif config.runtime.world_size > 1:
        ranks.launch(job, sweep.this_sweep().get("parent_run_id"))
    else:
        Runner(job).run()
    log.info("run folder: %s", job.run_dir)


hydra_job = hydra.main(version_base="1.3", config_path="../conf", config_name="config")(job)


def one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines (option lists, full_key, object_type)."""
    parts = []
    for err in (exc, exc.__cause__):
        if err is None:
            continue
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        lines = [line for line in lines if not line.startswith(("object_type=", "reference_type="))]
        if "Config search path:" in lines:  # MissingConfigException: keep the available options only
            lines = lines[: lines.index("Config search path:")]
        if len(lines) > 2 and lines[1].startswith("Available options"):
            lines = [lines[0], lines[1].rstrip(":") + ": " + ", ".join(lines[2:])]
        if lines:
            parts.append(lines[0] + (" (" + ", ".join(lines[1:]) + ")" if lines[1:] else ""))
    return ": ".join(parts)


def _terminated(signum, frame) -> None:
    """SIGTERM ends a run the way Ctrl-C does: the stage stops, the run is marked KILLED."""
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    try:
        _main()
    finally:
        # Everything is written and the process ends: the collector's pass at exit over those
        # objects (seconds after a short run) would only free memory the exit gives back anyway.
        gc.freeze()


def _main() -> None:
    # Exceptions reach this function instead of Hydra's printer, so config mistakes exit 2.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    signal.signal(signal.SIGTERM, _terminated)
    register_schemas()
    if bad := untrusted_targets(sys.argv[1:]) or launchers.cluster_launch_problem(sys.argv[1:]):
        print(f"config error: {bad}", file=sys.stderr)
        sys.exit(2)
    try:
        hydra_job()
        if failed := sweep.FAILED_JOBS:
            print(f"sweep: {len(failed)} job(s) failed: {'; '.join(failed)}", file=sys.stderr)
            sys.exit(1)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (HydraException, OmegaConfBaseException) as exc:
        print(f"config error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted: the run is marked KILLED; its folder keeps what was written", file=sys.stderr)
        sys.exit(130)


def untrusted_targets(overrides: list[str]) -> str | None:
    """Hydra instantiates any `_target_` it is given (callbacks, launchers): one from the command
    line may only name this package's own classes or Hydra's plugins."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.endswith("_target_") and not value.startswith(("pipeline.", "hydra_plugins.", "hydra.")):
            return f"{key}={value}: only pipeline.* (and Hydra's own plugins) can be instantiated"
    return None


if __name__ == "__main__":
    main()

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import launchers, ranks, sweep
from pipeline.backend_specs import spec
from pipeline.config import (
    PipelineConfig,
    register_schemas,
    resolve_attention,
    resolve_backend,
    runs_on_cuda,
    typed,
    validate,
)
from pipeline.devices import free_memory, resolve_device, resolve_dtype
from pipeline.errors import ConfigError, RunFailed
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


@dataclass
class CheckedConfig:
    """A config that passed every check that needs no weights."""

    config: PipelineConfig
    hf_config: Any
    model_cls: type
    params: int  # counted on the meta device


def check_config(cfg: DictConfig, cuda_available: bool) -> CheckedConfig:
    """Every check that needs no weights, in order, or a ConfigError that names the key and the fix.
    The model folder, its tokenizer and image processor are read; the last checks run on the model
    built on the meta device (no memory)."""
    from pipeline.models import checkpoint, meta, zoo
    from pipeline.models.tokenizer import chat_template_of, has_tokenizer
    from pipeline.runtime import queries
    from pipeline.runtime.requests import check_images, check_workload, sources_of
    from pipeline.transforms import registry

    config = typed(cfg)
    validate(config, cuda_available)
    transforms = registry.parse(config.transforms)
    if config.profile.waterfall:
        from pipeline import waterfall

        waterfall.check(transforms)
    model_cfg = config.model
    if model_cfg.checkpoint:
        checkpoint.check_folder(model_cfg.checkpoint, need_weights=model_cfg.skip_loading_weights is not True)
    parsed = queries.parse(config.prompt.queries)
    hf_config = zoo.build_hf_config(model_cfg)
    folder = model_cfg.checkpoint
    queries.check(parsed, has_tokenizer(folder), chat_template_of(folder) is not None, zoo.is_vlm(hf_config))
    check_images(config.prompt.images, hf_config)
    model_cls = zoo.resolve_model_class(model_cfg, hf_config)
    skeleton = meta.meta_model(model_cls, hf_config)
    check_workload(config, hf_config, sources_of(folder, hf_config, skeleton, config.prompt.image_layout))
    check_layer_kinds(config, hf_config)
    check_attention_options(config, hf_config, cuda_available)
    check_replays(config, hf_config, cuda_available)
    ranks.check_world(config, hf_config, runs_on_cuda(config, cuda_available), _multirun())
    meta.check_submodules("capture.submodules", config.capture.submodules, skeleton)
    if config.capture.mode == "partial" and not config.capture.submodules and zoo.is_vlm(hf_config):
        meta.check_language_model(skeleton, zoo.text_config_of(hf_config))
    return CheckedConfig(config, hf_config, model_cls, meta.parameter_count(skeleton))


# Decoder-layer kinds (a text config's `layer_types`) whose state the runtime's paged KV cache holds.
# Any other keeps a per-sequence state of its own (LFM2's short convolutions, Mamba and
# linear-attention layers) that a captured model's steps would not carry from one to the next.
CACHED_LAYER_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}


def check_layer_kinds(config: PipelineConfig, hf_config) -> None:
    """A captured language model keeps its state in the paged KV cache only: a model with layers of
    another kind runs eager (capture=none, Hugging Face's own cache) or the run stops here."""
    from pipeline.models import zoo

    if config.capture.mode == "none":
        return
    text = zoo.text_config_of(hf_config)
    other = sorted(set(getattr(text, "layer_types", None) or []) - CACHED_LAYER_KINDS)
    if other:
        raise ConfigError(
            f"model_type={text.model_type} has {', '.join(other)} layers (layer_types), whose state from one "
            "step to the next the captured runtime's paged KV cache does not hold; use capture=none"
        )


def check_attention_options(config: PipelineConfig, hf_config, cuda_available: bool) -> None:
    """The cached attention backend implements what this model's attention needs (a window, a logit
    cap, bidirectional spans, ...), or the run stops here naming the option."""
    from pipeline.attention import SUPPORTS
    from pipeline.models.masks import attention_options

    if config.capture.mode == "none" or "insert_cached_attention" not in config.transforms:
        return
    if (config.transforms["insert_cached_attention"] or {}).get("enabled", True) is False:
        return
    backend = resolve_attention(config.attention.name, runs_on_cuda(config, cuda_available))
    for option, why in attention_options(hf_config).items():
        if option not in SUPPORTS[backend]:
            others = [name for name, options in SUPPORTS.items() if option in options]
            fix = f"use attention={' or attention='.join(others)}" if others else "run capture=none"
            raise ConfigError(
                f"attention={backend} has no {option} attention, which this model needs ({why}); {fix}"
            )


def check_replays(config: PipelineConfig, hf_config, cuda_available: bool) -> None:
    """A backend that replays CUDA graphs needs each step's inputs in fixed shapes; a model that
    cross-attends vision states (models/cross_attention.py) takes as many as the step's sequences
    bring, so it runs with torch-compile (backend=auto picks it)."""
    from pipeline.models import zoo

    backend = resolve_backend(
        config, runs_on_cuda(config, cuda_available), not zoo.takes_vision_states(hf_config)
    )
    if spec(backend).replays and zoo.takes_vision_states(hf_config):
        raise ConfigError(
            f"backend={backend} replays CUDA graphs of fixed input shapes, and {config.model.name}'s language "
            "model cross-attends vision states whose count changes with each step's images; use "
            "backend=torch-compile"
        )


def _job(cfg: DictConfig) -> None:
    checked = check_config(cfg, _cuda_available())
    if checked.config.dry_run:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return
    from pipeline.models.memory import auto_dtype, check_fits
    from pipeline.runner import Runner
    from pipeline.state import Job

    config = checked.config
    device = resolve_device(config.device)
    note = None
    if config.dtype == "auto":
        dtype, note = auto_dtype(checked.params, checked.hf_config, config.runtime, device)
    else:
        dtype = resolve_dtype(config.dtype, device)
    # the memory check's shard suggestion must pass check_shard_weights too
    shard_fix = "runtime.tp_weights=shard" + (
        " profile.reference=none" if ranks.profiles_eager_reference(config) else ""
    )
    check_fits(checked.params, checked.hf_config, config.runtime, config.model.name, dtype, device, shard_fix)
    from pipeline.models import zoo

    replays = not zoo.takes_vision_states(checked.hf_config)
    if config.backend.piecewise and spec(resolve_backend(config, device.type == "cuda", replays)).replays:
        from pipeline.backends.cudagraph import token_buckets
        from pipeline.models.memory import check_piecewise_fits, free_bytes

        buckets = token_buckets(config.backend, config.runtime)
        capture_head = config.backend.piecewise_capture_lm_head
        check_piecewise_fits(
            checked.params,
            checked.hf_config,
            config.runtime,
            buckets,
            capture_head,
            dtype,
            free_bytes(device),
        )
    if note:
        log.warning(note)
    hydra_cfg = HydraConfig.get()
    job = Job(
        config, checked.hf_config, Path(hydra_cfg.runtime.output_dir), dtype, device,
        _job_name(hydra_cfg), tuple(hydra_cfg.overrides.task),
    )  # fmt: skip
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

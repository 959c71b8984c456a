"""A config becomes a Job here, and only here: every check that needs no weights, in order, then
the device, the dtype and the memory check, so the CLI, the bench and the tests run only jobs the
CLI would run. A mistake is a ConfigError that names the key and the fix, before anything is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline import ranks
from pipeline.backend_specs import spec
from pipeline.config import PipelineConfig, resolve_attention, resolve_backend, runs_on_cuda, typed, validate
from pipeline.devices import resolve_device, resolve_dtype
from pipeline.errors import ConfigError
from pipeline.state import Job

log = logging.getLogger(__name__)


@dataclass
class CheckedConfig:
    """A config that passed every check that needs no weights."""

    config: PipelineConfig
    hf_config: Any
    model_cls: type
    params: int  # counted on the meta device


def check_config(cfg: DictConfig, cuda_available: bool, multirun: bool = False) -> CheckedConfig:
    """Every check that needs no weights, in order, or a ConfigError that names the key and the fix.
    The model folder, its tokenizer and image processor are read; the last checks run on the model
    built on the meta device (no memory). multirun: the job is one of a sweep's."""
    from pipeline.models import checkpoint, images, meta, zoo
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
    if zoo.is_vlm(hf_config):
        images.check_image_token(hf_config)
    check_images(config.prompt.images, hf_config)
    model_cls = zoo.resolve_model_class(model_cfg, hf_config)
    skeleton = meta.meta_model(model_cls, hf_config)
    check_workload(config, hf_config, sources_of(folder, hf_config, skeleton, config.prompt.image_layout))
    check_layer_kinds(config, hf_config)
    check_attention_options(config, hf_config, cuda_available)
    check_replays(config, hf_config, cuda_available)
    ranks.check_world(config, hf_config, runs_on_cuda(config, cuda_available), multirun)
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


def checked_job(
    cfg: DictConfig,
    run_dir: Path,
    cuda_available: bool,
    name: str | None = None,
    overrides: tuple[str, ...] = (),
    multirun: bool = False,
) -> Job:
    """The Job `python -m pipeline` runs for cfg in run_dir: check_config, then the device and
    dtype (`dtype=auto` picks what fits, said in a warning) and the checks that need them: the
    model's memory, and with piecewise CUDA graphs the memory of their buckets."""
    from pipeline.models import zoo
    from pipeline.models.memory import auto_dtype, check_fits

    checked = check_config(cfg, cuda_available, multirun)
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
    return Job(config, checked.hf_config, run_dir, dtype, device, name, overrides)

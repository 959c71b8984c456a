"""The offline model zoo: a `model=` config becomes a Hugging Face config and model class, no hub access.

`conf/model/<name>.yaml` holds the published config.json values (`hf_config`) and the overrides
(`model_kwargs`, deep-merged on top, e.g. `text_config.num_hidden_layers: 2`). A checkpoint folder,
when given, supplies its own config.json instead of `hf_config`.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.errors import ConfigError

# The seed's `model_factory` values, and `auto`: the class model.architecture (or the checkpoint's
# config.json) names. A named factory pins one class; the Auto factories resolve the class from the
# config's model_type, as Hugging Face does.
MODEL_FACTORIES = ("auto", "AutoModelForCausalLM", "AutoModelForImageTextToText", "Mistral3VLM")


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _config_class(model_type: str):
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model.hf_config.model_type={model_type} is not known to transformers")
    return CONFIG_MAPPING[model_type]


def _readers(config_cls: type) -> str:
    """The source of the modeling module beside a config class: what the model reads off its config."""
    import importlib
    import inspect

    name = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        return inspect.getsource(importlib.import_module(name))
    except (ImportError, OSError, TypeError):
        return ""


def _known_keys(config_cls: type, readers: str) -> set[str]:
    """Keys a published config.json of this class may carry: the class's fields and defaults, its
    __init__ parameters, its attribute_map (both names), and any key the modeling code reads off a
    config (`config.head_dim`, `getattr(config, "head_dim", ...)`: Qwen3-MoE's head_dim, which the
    class keeps as a plain attribute), here or in the parent model's code (PaliGemma reads its vision
    config's projection_dim), and the generation settings generate takes from a model config."""
    import inspect
    import re

    from transformers import GenerationConfig

    defaults = config_cls()
    known = set(defaults.to_dict()) | set(vars(defaults)) | {"model_type", "rope_scaling", "rope_theta"}
    known |= set(GenerationConfig().to_dict())  # what generate reads off a model config (eos_token_id)
    for cls in config_cls.__mro__:
        if "__init__" in vars(cls):
            known |= set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    attribute_map = getattr(config_cls, "attribute_map", {}) or {}
    known |= set(attribute_map) | set(attribute_map.values())
    known |= set(re.findall(r"(?<=config)\.(\w+)", readers))  # config.x, config.vision_config.x
    known |= set(re.findall(r"getattr\(\s*[\w.]*config\s*,\s*[\"'](\w+)[\"']", readers))
    return known


def _check_keys(values: Mapping[str, Any], config_cls: type, key_prefix: str, readers: str = "") -> None:
    """Unknown keys would silently become attributes of an HF config; refuse a key no part of
    transformers knows for this class (a misspelling), accept every key a published config carries."""
    readers = readers + _readers(config_cls)
    known = _known_keys(config_cls, readers)
    defaults = config_cls()
    for key, value in values.items():
        if key not in known:
            raise ConfigError(
                f"{key_prefix}.{key} is not a field of {config_cls.__name__}; check the spelling"
            )
        sub_config = getattr(defaults, key, None)
        if (
            isinstance(value, Mapping)
            and hasattr(sub_config, "to_dict")
            and hasattr(sub_config, "model_type")
        ):
            sub_cls = _config_class(value.get("model_type", sub_config.model_type))
            _check_keys(value, sub_cls, f"{key_prefix}.{key}", readers)


LAYER_COUNTS = ("num_hidden_layers", "depth")  # keys a checkpoint may be loaded with fewer of


def _check_against_checkpoint(saved: dict, overrides: dict, folder: str, prefix: str = "") -> None:
    """model_kwargs may keep fewer layers than a checkpoint has (its first N load); any other
    difference would load weights into a different model (HF random-inits what is missing)."""
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(saved.get(key), dict):
            _check_against_checkpoint(saved[key], value, folder, f"{name}.")
            continue
        if key not in saved or saved[key] == value:
            continue
        if key in LAYER_COUNTS and isinstance(value, int) and 0 < value <= saved[key]:
            continue
        raise ConfigError(
            f"model.model_kwargs.{name}={value} disagrees with the checkpoint's config.json ({saved[key]}) in "
            f"{folder}; drop the override (only fewer num_hidden_layers may be loaded from a checkpoint)"
        )


def hf_config_values(model_cfg: DictConfig) -> dict[str, Any]:
    """The config.json dict this run builds from: checkpoint or hf_config, then model_kwargs."""
    if model_cfg.checkpoint:
        config_file = Path(model_cfg.checkpoint) / "config.json"
        if not config_file.is_file():
            raise ConfigError(
                f"model.checkpoint={model_cfg.checkpoint} has no config.json; point it at a Hugging Face model folder"
            )
        base = json.loads(config_file.read_text())
        _check_against_checkpoint(base, _plain(model_cfg.model_kwargs), model_cfg.checkpoint)
    else:
        base = _plain(model_cfg.hf_config)
    return _per_layer_lists_cut(deep_merge(base, _plain(model_cfg.model_kwargs)))


def _per_layer_lists_cut(values: dict[str, Any]) -> dict[str, Any]:
    """Fewer layers than a config lists per-layer values for (`layer_types` of a saved config.json):
    the first layers keep theirs, as their weights are the first layers' of the checkpoint."""
    layers = values.get("num_hidden_layers")
    types = values.get("layer_types")
    if isinstance(layers, int) and isinstance(types, list) and len(types) > layers:
        values = {**values, "layer_types": types[:layers]}
    return {k: _per_layer_lists_cut(v) if isinstance(v, dict) else v for k, v in values.items()}


def build_hf_config(model_cfg: DictConfig):
    """Validated `PretrainedConfig` for the run (cheap: no weights)."""
    values = hf_config_values(model_cfg)
    if "model_type" not in values:
        raise ConfigError(
            f"model.hf_config of model={model_cfg.name} has no model_type; add the published one"
        )
    config_cls = _config_class(values["model_type"])
    if not model_cfg.checkpoint:
        _check_keys(_plain(model_cfg.hf_config), config_cls, "model.hf_config")
    _check_keys(_plain(model_cfg.model_kwargs), config_cls, "model.model_kwargs")
    kwargs = {k: v for k, v in values.items() if k != "model_type"}
    try:
        return config_cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the config class's own validation
        where = (
            "model.checkpoint's config.json with model.model_kwargs"
            if model_cfg.checkpoint
            else "model.hf_config"
        )
        detail = str(exc).strip().splitlines()[-1].strip()
        raise ConfigError(f"{where} does not make a {config_cls.__name__}: {detail}") from None


def resolve_model_class(model_cfg, hf_config) -> type:
    """The Hugging Face class to build. `auto` takes model.architecture, else the config's own
    `architectures` (what a checkpoint's config.json names); the Auto factories resolve the class
    from the config's type, as Hugging Face does."""
    import transformers

    factory = model_cfg.model_factory
    if factory == "auto":
        name = model_cfg.architecture or next(iter(getattr(hf_config, "architectures", None) or []), None)
        cls = getattr(transformers, name, None) if name else None
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise ConfigError(
                f"model.architecture={name} is not a model class of transformers "
                f"{transformers.__version__}; set model.architecture to one (e.g. LlamaForCausalLM)"
            )
        return cls
    if factory == "Mistral3VLM":
        cls = transformers.Mistral3ForConditionalGeneration
    elif factory in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        auto = getattr(transformers, factory)
        mapping = auto._model_mapping
        if type(hf_config) not in mapping:
            raise ConfigError(
                f"model.model_factory={factory} cannot build a {type(hf_config).__name__}; "
                f"use one of: {', '.join(MODEL_FACTORIES)}"
            )
        cls = mapping[type(hf_config)]
    else:
        raise ConfigError(
            f"model.model_factory={factory} is not known; use one of: {', '.join(MODEL_FACTORIES)}"
        )
    if model_cfg.architecture and cls.__name__ != model_cfg.architecture:
        raise ConfigError(
            f"model.architecture={model_cfg.architecture} but model.model_factory={factory} builds {cls.__name__}; "
            "make them agree"
        )
    return cls


def text_config_of(hf_config):
    """The language model's config: the nested text_config of a VLM, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


# Forward parameters that carry images into a model (Fuyu embeds `image_patches` with one linear
# layer and has no vision_config)
IMAGE_INPUTS = ("pixel_values", "image_patches")


def is_vlm(hf_config) -> bool:
    """Whether the model takes images: the forward of the class transformers builds for this config
    (image-text-to-text first, else causal LM) names an image input, whatever the config's shape;
    a config neither maps, by its vision_config."""
    model_cls = _model_class(type(hf_config))
    if model_cls is None:
        return getattr(hf_config, "vision_config", None) is not None
    return any(name in inspect.signature(model_cls.forward).parameters for name in IMAGE_INPUTS)


def takes_vision_states(hf_config) -> bool:
    """Whether images reach the language model through cross-attention (models/cross_attention.py)."""
    from pipeline.models import cross_attention

    model_cls = _model_class(type(hf_config))
    return model_cls is not None and cross_attention.takes_vision_states(model_cls)


@functools.cache
def _model_class(config_cls: type) -> type | None:
    """The class transformers builds for a config class: image-text-to-text first, else causal LM."""
    import transformers

    for auto in (transformers.AutoModelForImageTextToText, transformers.AutoModelForCausalLM):
        if config_cls in auto._model_mapping:
            model_cls = auto._model_mapping[config_cls]
            return model_cls[0] if isinstance(model_cls, tuple | list) else model_cls
    return None


def eos_ids(hf_config) -> set[int]:
    """The language model's end-of-sequence token ids (one id or a list in the config)."""
    eos = text_config_of(hf_config).eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))

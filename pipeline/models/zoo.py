"""The offline model zoo: a `model=` config becomes a Hugging Face config and model class, no hub access.

`conf/model/<name>.yaml` holds the published config.json values (`hf_config`) and the overrides
(`model_kwargs`, deep-merged on top, e.g. `text_config.num_hidden_layers: 2`). A checkpoint folder,
when given, supplies its own config.json instead of `hf_config`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.errors import ConfigError

# The seed's `model_factory` values. A named factory pins one class; the Auto factories resolve
# the class from the config's model_type, as Hugging Face does.
MODEL_FACTORIES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "Mistral3VLM")


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


def _check_keys(values: Mapping[str, Any], config_cls: type, key_prefix: str) -> None:
    """Unknown keys would silently become attributes of an HF config; refuse them instead."""
    defaults = config_cls()
    known = set(defaults.to_dict()) | set(vars(defaults)) | {"model_type", "rope_scaling", "rope_theta"}
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
            _check_keys(value, sub_cls, f"{key_prefix}.{key}")


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
        if key == "num_hidden_layers" and isinstance(value, int) and 0 < value <= saved[key]:
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
    return deep_merge(base, _plain(model_cfg.model_kwargs))


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
    return config_cls(**kwargs)


def resolve_model_class(model_cfg: DictConfig, hf_config) -> type:
    import transformers

    factory = model_cfg.model_factory
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
    if cls.__name__ != model_cfg.architecture:
        raise ConfigError(
            f"model.architecture={model_cfg.architecture} but model.model_factory={factory} builds {cls.__name__}; "
            "make them agree"
        )
    return cls


def text_config_of(hf_config):
    """The language model's config: the nested text_config of a VLM, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


def is_vlm(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def eos_ids(hf_config) -> set[int]:
    """The language model's end-of-sequence token ids (one id or a list in the config)."""
    eos = text_config_of(hf_config).eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))

"""The model on the meta device: its structure and parameter count, without memory. The checks
that run before any weight is allocated use it: will the model fit (memory.py), and does every
setting that names a part of the model name one that exists."""

from __future__ import annotations

import difflib

import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.graphs import find_language_models, stack_candidates


def meta_model(model_cls: type, hf_config) -> nn.Module:
    # Everything on meta, buffers too: only shapes and the module tree are needed.
    with torch.device("meta"):
        return model_cls._from_config(hf_config)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def check_submodules(key: str, paths: list[str] | None, model: nn.Module) -> None:
    """Each dotted path names a submodule of the model; else a ConfigError naming the key, the
    closest paths and the top-level modules."""
    known = [name for name, _ in model.named_modules() if name]
    for index, path in enumerate(paths or []):
        if path in known:
            continue
        close = difflib.get_close_matches(path, known, n=3, cutoff=0.6)
        top = [name for name, _ in model.named_children()]
        hint = f"closest: {', '.join(close)}; " if close else ""
        raise ConfigError(
            f"{key}[{index}]={path} is not a submodule of {type(model).__name__}; {hint}"
            f"its top-level modules are {', '.join(top)}"
        )


def check_language_model(model: nn.Module, text_config) -> None:
    """capture=partial of a VLM captures its language model: exactly one must be found, else a
    ConfigError listing the candidates and how to name one."""
    found = find_language_models(model, text_config)
    if len(found) == 1:
        return
    what = "no language model" if not found else f"{len(found)} language models ({', '.join(found)})"
    raise ConfigError(
        f"capture=partial found {what} in {type(model).__name__} (a module with {text_config.num_hidden_layers} "
        f"`layers` and an embedding of at least {text_config.vocab_size} tokens); candidates: "
        f"{'; '.join(stack_candidates(model)) or 'none'}; name one with capture.submodules=[path]"
    )

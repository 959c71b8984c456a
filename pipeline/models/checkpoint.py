"""A Hugging Face model folder as users have it: config.json, safetensors weights (one file, several,
or shards named by model.safetensors.index.json), in any dtype, with tokenizer files, a chat
template and an image processor config beside them.

`check_folder` looks at it before anything is built (exit 2 on a folder that cannot be loaded:
no config, a shard the index names missing, pickled weights only). `load` reads the weights with
Hugging Face's own `from_pretrained` (safetensors only, never the network) and makes its loading
report a contract: a weight of the model that the folder does not hold fails the load, naming it,
where Hugging Face would initialise it randomly and go on; weights the folder holds that the model
does not use (a checkpoint of 40 layers run with two) are reported. `load_slices` is the
tensor-parallel rank's load under `runtime.tp_weights=shard`: the weights the shard transform splits
are read later, each rank only its slices of them (models/deferred.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pipeline.errors import ConfigError, StageFailure
from pipeline.models import build
from pipeline.models.deferred import DeferredWeights, Recipe

INDEX = "model.safetensors.index.json"
SHOWN = 5  # names listed in a message; the count says the rest


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files the weights are in: the index's shards, or every *.safetensors."""
    index = folder / INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [folder / shard for shard in shards]
    return sorted(folder.glob("*.safetensors"))


def check_folder(path: str, need_weights: bool) -> None:
    """The folder can be loaded: a ConfigError naming the key and the fix when it cannot."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"model.checkpoint={path} is not a folder; point it at a Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.checkpoint={path} has no config.json; point it at a Hugging Face model folder"
        )
    if not need_weights:
        return
    files = weight_files(folder)
    if missing := [f.name for f in files if not f.is_file()]:
        raise ConfigError(
            f"model.checkpoint={path}: {INDEX} names {len(missing)} shard(s) that are not there: "
            f"{', '.join(missing[:SHOWN])}; copy them in, or set model.skip_loading_weights=true for random weights"
        )
    if not files:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        what = (
            f"only pickled weights ({', '.join(pickled[:SHOWN])}), which are never loaded"
            if pickled
            else "no weights"
        )
        raise ConfigError(
            f"model.checkpoint={path} has {what}; convert them to safetensors, or set "
            "model.skip_loading_weights=true to run its config with random weights"
        )


@dataclass
class LoadReport:
    params: int
    bytes: int
    seconds: float
    unexpected: list[str] = field(default_factory=list)  # in the folder, not used by the model


def _names(keys: list[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


@contextlib.contextmanager
def _quiet_transformers():
    """Hugging Face prints its own table of unexpected keys; the load's report says it once."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def load(
    model_cls: type,
    path: str,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool,
    attn_implementation: str | None = None,
) -> tuple[nn.Module, LoadReport]:
    start = time.perf_counter()
    with _quiet_transformers():
        model, info = model_cls.from_pretrained(
            path,
            config=hf_config,
            dtype=dtype,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            output_loading_info=True,
        )
    missing, mismatched = (
        list(info["missing_keys"]),
        [str(k[0]) if isinstance(k, tuple) else str(k) for k in info["mismatched_keys"]],
    )
    if missing:
        raise StageFailure(
            f"model.checkpoint={path} lacks {len(missing)} weight(s) of {model_cls.__name__}: {_names(missing)}; "
            "Hugging Face would initialise them randomly: give a complete folder, or "
            "model.skip_loading_weights=true for random weights throughout"
        )
    if mismatched:
        raise StageFailure(
            f"model.checkpoint={path} holds {len(mismatched)} weight(s) of other shapes than {model_cls.__name__} "
            f"expects: {_names(mismatched)}; check model.model_kwargs against the folder's config.json"
        )
    model = model.to(device).eval()
    unique = {id(p): p for p in model.parameters()}.values()
    return model, LoadReport(
        params=sum(p.numel() for p in unique),
        bytes=sum(p.numel() * p.element_size() for p in unique),
        seconds=time.perf_counter() - start,
        unexpected=sorted(info["unexpected_keys"]),
    )


@dataclass
class Assembled:
    """A weight Hugging Face assembles on load from several of the folder's tensors (a Mixtral
    layer's experts stacked from per-expert w1/w3/w2): the model's conversion mapping's converter and,
    per source pattern, the (file, key) of each part in expert order."""

    converter: object  # transformers' WeightConverter
    # source pattern -> (expert index, file, key) of each part
    parts: dict[str, list[tuple[int, str, str]]] = field(default_factory=dict)

    def read(self, opened, hf_config) -> torch.Tensor:
        """The weight as Hugging Face's own conversion ops build it from the parts."""
        tensors = {
            pattern: [opened(file).get_tensor(key) for _, file, key in sorted(parts)]
            for pattern, parts in self.parts.items()
        }
        for op in self.converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
                config=hf_config,
            )
        (tensor,) = tensors.values()
        return tensor


def _part_index(pattern: str, key: str) -> int:
    """The number the pattern's `*` stands for in key (the expert), 0 for a pattern without one."""
    if "*." not in pattern:
        return 0
    found = re.search(re.escape(pattern).replace(re.escape("*."), r"(\d+)\."), key)
    return int(found.group(1)) if found else 0


def _sources(
    model: nn.Module, folder: Path
) -> tuple[dict[str, tuple[str, str]], dict[str, Assembled], list[str]]:
    """Model parameter name -> (safetensors file, key) of the folder's tensor that loads into it
    unchanged, named as Hugging Face's own loading names it (the model's conversion mapping: a
    saved Mistral3 keeps its language model at `language_model.model.*`, say); the parameters
    Hugging Face converts on load from several tensors (experts stacked from per-expert tensors:
    save_pretrained writes Mixtral's and Qwen3-MoE's experts one by one), each with its parts; and
    the folder's keys that load into nothing."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    names = dict.fromkeys(model.state_dict(keep_vars=True))
    sources, assembled, unused = {}, {}, []
    for file in weight_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                target, pattern = rename_source_key(
                    key, renamings, converters, model.base_model_prefix, names
                )
                if target not in names:
                    unused.append(key)
                elif pattern is None:
                    sources[target] = (str(file), key)
                else:
                    converter = next(c for c in converters if pattern in c.source_patterns)
                    parts = assembled.setdefault(target, Assembled(converter)).parts
                    parts.setdefault(pattern, []).append((_part_index(pattern, key), str(file), key))
    return sources, assembled, unused


def load_slices(
    model_cls: type,
    path: str,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    attn_implementation: str | None,
    defer: build.DeferWhere,
    deferred: DeferredWeights,
) -> tuple[nn.Module, LoadReport]:
    """runtime.tp_weights=shard from a checkpoint: the model built on the meta device; each weight
    `defer` names becomes a placeholder whose slices are read later from its file alone
    (models/deferred.py), every other weight is read whole. The same contract as `load`: a weight
    of the model the folder lacks, or holds in another shape, fails the load naming it."""
    from safetensors import safe_open

    start = time.perf_counter()
    model = build.on_meta(model_cls, hf_config, device, attn_implementation)
    sources, assembled, unused = _sources(model, Path(path))
    done: dict[int, nn.Parameter] = {}  # id(meta param) -> its tensor: tied weights stay one
    missing, mismatched = [], []
    with contextlib.ExitStack() as files:
        handles = {}

        def opened(file: str):
            if file not in handles:
                handles[file] = files.enter_context(safe_open(file, framework="pt", device="cpu"))
            return handles[file]

        for module_path, module, name, param in build.parameter_owners(model):
            full = f"{module_path}.{name}".lstrip(".")
            if id(param) not in done:
                if full in assembled:  # whole: a slice would need a slice of every part (experts stay whole)
                    tensor = assembled[full].read(opened, hf_config)
                    if tuple(tensor.shape) != tuple(param.shape):
                        mismatched.append(f"{full} {tuple(tensor.shape)} vs {tuple(param.shape)}")
                        continue
                    done[id(param)] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
                    module._parameters[name] = done[id(param)]
                    continue
                if full not in sources:
                    missing.append(full)
                    continue
                file, key = sources[full]
                stored = opened(file).get_slice(key)
                if tuple(stored.get_shape()) != tuple(param.shape):
                    mismatched.append(f"{full} {tuple(stored.get_shape())} vs {tuple(param.shape)}")
                    continue
                if defer(module_path, module, name):
                    recipe = Recipe(full, tuple(param.shape), dtype, device, source=(file, key))
                    done[id(param)] = deferred.placeholder(recipe)
                else:
                    tensor = stored[:].to(device=device, dtype=dtype)
                    done[id(param)] = nn.Parameter(tensor, requires_grad=False)
            module._parameters[name] = done[id(param)]
    if missing:
        raise StageFailure(
            f"model.checkpoint={path} lacks {len(missing)} weight(s) of {model_cls.__name__}: "
            f"{_names(missing)}; Hugging Face would initialise them randomly: give a complete folder, or "
            "model.skip_loading_weights=true for random weights throughout"
        )
    if mismatched:
        raise StageFailure(
            f"model.checkpoint={path} holds {len(mismatched)} weight(s) of other shapes than {model_cls.__name__} "
            f"expects: {_names(mismatched)}; check model.model_kwargs against the folder's config.json"
        )
    model.eval()
    unique = list(done.values())
    return model, LoadReport(
        params=sum(p.numel() for p in unique),
        bytes=sum(p.untyped_storage().nbytes() for p in unique),
        seconds=time.perf_counter() - start,
        unexpected=sorted(unused),
    )


def describe_unexpected(report: LoadReport) -> str:
    return f"{len(report.unexpected)} weight(s) in the folder the model does not use: {_names(report.unexpected)}"

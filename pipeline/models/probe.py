"""What an eager model does with a call, asked of the model itself rather than of a table per family.

`first_calls`: the arguments submodules receive on their first call. The forward stops once every
one of them has been entered, so what runs after (the language model itself, when only its inputs
are wanted) never runs: with `runtime.tp_weights=shard` its linears are placeholders until the
shard transform fills them (models/deferred.py).

`first_position`: where the positions its language model receives start when the caller gives
none. Most count from 0; PaliGemma's parent adds 1 (`position_ids.unsqueeze(0) + 1`, "Paligemma
positions are 1-indexed"); Kosmos-2's language model receives none and counts its own from its
padding id + 1 (its sinusoidal table's rows). The runtime, which passes positions explicitly, and
a graph that defaults them must add the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Entered(Exception):
    """Every submodule asked for has been entered: the rest of the forward is not needed."""


def first_calls(model: nn.Module, paths: list[str], call: dict[str, Any]) -> dict[str, tuple[tuple, dict]]:
    """Run the model on `call` until each submodule at `paths` has been entered; path -> the (args,
    kwargs) of its first call. A path the forward never enters is missing from the result."""
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for path in paths:

        def enter(_module, args, kwargs, path=path):
            seen.setdefault(path, (args, kwargs))
            if len(seen) == len(paths):
                raise _Entered

        handles.append(model.get_submodule(path).register_forward_pre_hook(enter, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**call)
    except _Entered:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return seen


def first_position(model: nn.Module, language_model_path: str, input_ids: torch.Tensor) -> int:
    """Read the position_ids the language model at `language_model_path` receives from the model on
    `input_ids` ([B, S], text only): their smallest value; where it receives none, where it counts
    its own from (`_counted_from`)."""
    if not language_model_path:
        return 0
    calls = first_calls(model, [language_model_path], {"input_ids": input_ids, "use_cache": False})
    positions = calls[language_model_path][1].get("position_ids") if calls else None
    if isinstance(positions, torch.Tensor):
        return int(positions.min())
    return _counted_from(model, language_model_path, input_ids)


MOST_OFFSET = 4  # the largest start tried; models count from 0, 1 or their padding id + 1


def _counted_from(model: nn.Module, language_model_path: str, input_ids: torch.Tensor) -> int:
    """Where a language model that counts its own positions starts: the offset whose explicit
    positions give its first layer the same inputs as none do (only its embeddings run); 0 where
    none does (a layer that receives positions only when given them)."""
    language_model = model.get_submodule(language_model_path)
    layers = next(
        (p for p, m in language_model.named_modules() if isinstance(m, nn.ModuleList) and len(m)), None
    )
    if layers is None:
        return 0
    layer = f"{language_model_path}.{layers}.0"
    call = {"input_ids": input_ids, "use_cache": False}
    own = _tensors(first_calls(model, [layer], call).get(layer))
    for offset in range(MOST_OFFSET + 1):
        positions = torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)
        given = {**call, "position_ids": positions.expand_as(input_ids).contiguous()}  # [B, S]
        mine = _tensors(first_calls(model, [layer], given).get(layer))
        if own and len(mine) == len(own) and all(torch.equal(a, b) for a, b in zip(mine, own, strict=True)):
            return offset
    return 0


def _tensors(call: tuple[tuple, dict] | None) -> list[torch.Tensor]:
    """The tensors of a recorded call, in order (positional, then by keyword)."""
    if call is None:
        return []
    args, kwargs = call
    values = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return [leaf for leaf in torch.utils._pytree.tree_leaves(values) if isinstance(leaf, torch.Tensor)]

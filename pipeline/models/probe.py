"""What an eager model does with a call, asked of the model itself rather than of a table per family.

`first_calls`: the arguments submodules receive on their first call. The forward stops once every
one of them has been entered, so what runs after (the language model itself, when only its inputs
are wanted) never runs: with `runtime.tp_weights=shard` its linears are placeholders until the
shard transform fills them (models/deferred.py).

`first_position`: where the positions its language model receives start when the caller gives
none. Most count from 0; PaliGemma's parent adds 1 (`position_ids.unsqueeze(0) + 1`, "Paligemma
positions are 1-indexed"). The runtime, which passes positions explicitly, and a graph that
defaults them must add the same.
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
    `input_ids` ([B, S], text only): their smallest value (0 when it receives none and counts
    itself, from 0)."""
    if not language_model_path:
        return 0
    calls = first_calls(model, [language_model_path], {"input_ids": input_ids, "use_cache": False})
    positions = calls[language_model_path][1].get("position_ids") if calls else None
    return int(positions.min()) if isinstance(positions, torch.Tensor) else 0

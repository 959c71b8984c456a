"""What an eager model does with a call, asked of the model itself rather than of a table per family.

`first_position`: where the positions its language model receives start when the caller gives
none. Most count from 0; PaliGemma's parent adds 1 (`position_ids.unsqueeze(0) + 1`, "Paligemma
positions are 1-indexed"). The runtime, which passes positions explicitly, and a graph that
defaults them must add the same.
"""

from __future__ import annotations

import torch
from torch import nn


def first_position(model: nn.Module, language_model_path: str, input_ids: torch.Tensor) -> int:
    """Run the model once on `input_ids` ([B, S], text only) and read the position_ids its language
    model at `language_model_path` receives: their smallest value (0 when it receives none and
    counts itself, from 0)."""
    if not language_model_path:
        return 0
    seen: list[torch.Tensor | None] = []

    def record(_module, _args, kwargs):
        seen.append(kwargs.get("position_ids"))

    handle = model.get_submodule(language_model_path).register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        handle.remove()
    positions = seen[0] if seen else None
    return int(positions.min()) if isinstance(positions, torch.Tensor) else 0

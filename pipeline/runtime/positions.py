"""Rotary positions of a request, as the model's own generate computes them.

Most models count 0..S-1. Qwen2.5-VL's multimodal RoPE gives an image's tokens their (t, h, w)
grid positions on three rows and every later token its text position plus the offset the grid
left (the delta): Hugging Face computes them with the model's `get_rope_index` when the processor
marks the image tokens (`mm_token_type_ids`), as it does for a real chat request. The same method
computes them here, on the request's own prompt, once; decode positions are the cached length plus
the delta.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.runtime.requests import Request


class Positions:
    def __init__(self, model: nn.Module, hf_config, offset: int = 0):
        """offset: where the model counts positions from (models/probe.py; PaliGemma: 1)."""
        self.offset = offset
        text = getattr(hf_config, "text_config", None) or hf_config
        self.mrope = bool((getattr(text, "rope_parameters", None) or {}).get("mrope_section"))
        self.rope_index = next(
            (m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index")), None
        )
        self.image_token = getattr(hf_config, "image_token_id", None)
        self._cache: dict[int, tuple[torch.Tensor, int]] = {}

    def of(self, request: Request) -> tuple[torch.Tensor | None, int]:
        """([3, S] grid positions, delta) of a multimodal-RoPE request with images; (None, 0) when its
        positions are plain (text positions on every row)."""
        if not (self.mrope and self.rope_index and "image_grid_thw" in request.images):
            return None, 0
        if request.seq_id not in self._cache:
            ids = torch.tensor(request.prompt)[None]  # [1, S]
            token_types = request.token_inputs.get("mm_token_type_ids")  # the processor's, else derived
            if token_types is None:
                token_types = ids == self.image_token  # 1 marks an image token, as the processor does
            token_types = token_types.reshape(1, -1).int().cpu()
            grid = request.images["image_grid_thw"].cpu()
            positions, delta = self.rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=grid)
            self._cache[request.seq_id] = (positions[:, 0], int(delta.reshape(-1)[0]))  # [3, S]
        return self._cache[request.seq_id]

    def forget(self, request: Request) -> None:
        self._cache.pop(request.seq_id, None)

    def prompt(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Positions of prompt tokens [start, end): [end - start], or [3, end - start] for grid ones."""
        grid, _ = self.of(request)
        if grid is None:
            return torch.arange(start + self.offset, end + self.offset)
        return grid[:, start:end]

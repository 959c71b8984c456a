"""Example inputs for export and the correctness check: token ids, and synthetic images for VLMs
(seeded noise through the family's preprocessing, see images.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.models.images import default_image_size, image_token_id, preprocess, synthetic_image

TEXT_LEN = 11  # prompt tokens around the image; odd, so no weight dimension shares the size


@dataclass
class ExampleInputs:
    text: dict[str, Any]  # kwargs of a text-only call of the whole model
    image: dict[str, Any] | None  # kwargs of a call with one image per sequence; None for text models


def random_ids(shape: tuple[int, ...], vocab: int, avoid: set[int], generator) -> torch.Tensor:
    # Special tokens (image slots, vision start) would change what the model does: redraw them.
    ids = torch.randint(0, vocab, shape, generator=generator)
    special = torch.isin(ids, torch.tensor(sorted(avoid), dtype=ids.dtype))
    while special.any():
        ids[special] = torch.randint(0, vocab, (int(special.sum()),), generator=generator)
        special = torch.isin(ids, torch.tensor(sorted(avoid), dtype=ids.dtype))
    return ids


def special_ids(config) -> set[int]:
    names = (
        "image_token_index",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "boi_token_index",
        "eoi_token_index",
    )
    return {getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)}


def make_example_inputs(
    config, batch: int, image_size: int | None, dtype: torch.dtype, device: torch.device, seed: int
) -> ExampleInputs:
    """A text-only call and, for VLMs, a call with one image per sequence; `use_cache=False`."""
    generator = torch.Generator().manual_seed(seed)
    text_config = getattr(config, "text_config", None) or config
    avoid = special_ids(config)
    text_ids = random_ids((batch, TEXT_LEN), text_config.vocab_size, avoid, generator).to(device)
    text = {"input_ids": text_ids, "use_cache": False}
    if getattr(config, "vision_config", None) is None:
        return ExampleInputs(text, None)
    size = image_size or default_image_size(config)
    images = preprocess(config, [synthetic_image(size, generator) for _ in range(batch)], dtype, device)
    # [text... , prefix, image tokens, suffix, text...]
    half = TEXT_LEN // 2
    body = random_ids((batch, TEXT_LEN), text_config.vocab_size, avoid, generator)
    image_part = torch.tensor([images.placeholder(image_token_id(config), i) for i in range(batch)])
    ids = torch.cat([body[:, :half], image_part, body[:, half:]], dim=1).to(device)
    return ExampleInputs(text, {"input_ids": ids, **images.kwargs, "use_cache": False})

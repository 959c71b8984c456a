"""Example inputs for export and the correctness check: token ids, and synthetic images for VLMs
(seeded noise through the family's preprocessing, see images.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.models import cross_attention, image_mask, masks, vision_experts
from pipeline.models.images import (
    IMAGES_FIRST,
    default_image_size,
    image_token_id,
    preprocess,
    synthetic_image,
    unsupported,
)
from pipeline.models.zoo import is_vlm

TEXT_LEN = 11  # prompt tokens around the image; odd, so no weight dimension shares the size


def cross_attention_rows(config, prompt: list[int], pixels: dict[str, torch.Tensor], row: int = 0):
    """[P, images, tiles]: which tiles each token of a prompt attends, for a family whose language
    model cross-attends the vision states; pixels: its images, one sequence per `row`."""
    tiles, max_tiles = cross_attention.tile_counts({k: v[row : row + 1] for k, v in pixels.items()})
    return cross_attention.token_mask(config.model_type, prompt, image_token_id(config), tiles, max_tiles)


@dataclass
class ExampleInputs:
    text: dict[str, Any]  # kwargs of a text-only call of the whole model
    image: dict[str, Any] | None  # kwargs of a call with one image per sequence; None for text models
    note: str = ""  # why a VLM has no image call


def random_ids(shape: tuple[int, ...], vocab: int, avoid: set[int], generator) -> torch.Tensor:
    # Special tokens (image slots, vision start) would change what the model does: redraw them.
    ids = torch.randint(0, vocab, shape, generator=generator)
    special = torch.isin(ids, torch.tensor(sorted(avoid), dtype=ids.dtype))
    while special.any():
        ids[special] = torch.randint(0, vocab, (int(special.sum()),), generator=generator)
        special = torch.isin(ids, torch.tensor(sorted(avoid), dtype=ids.dtype))
    return ids


def special_ids(config) -> set[int]:
    """Ids a synthetic prompt leaves out: the image markers, and the text model's padding, begin and
    end tokens (Hugging Face's generate takes a pad id inside a prompt for padding and masks it)."""
    names = (
        "image_token_index",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "boi_token_index",
        "eoi_token_index",
    )
    found = {getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)}
    text_config = getattr(config, "text_config", None) or config
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text_config, name, None)
        found |= {value} if isinstance(value, int) else set(value or ())
    return found


def with_token_types(config, call: dict[str, Any]) -> dict[str, Any]:
    """The call with the token_type_ids the family's processor would return (models/masks.py), for a
    family whose mask reads them: without them Hugging Face's model builds another mask."""
    ids = call["input_ids"]
    types = [masks.token_type_ids(config, row) for row in ids.tolist()]
    if types[0] is None:
        return call
    return {**call, "token_type_ids": torch.tensor(types, device=ids.device)}


def make_example_inputs(
    config,
    batch: int,
    image_size: int | None,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    model=None,
    processor=None,
) -> ExampleInputs:
    """A text-only call and, for VLMs, a call with one image per sequence; `use_cache=False`.
    model: one of the architecture (meta-device serves), for a fixed-size family's token count;
    processor: the checkpoint's image processor, if it has one."""
    generator = torch.Generator().manual_seed(seed)
    text_config = getattr(config, "text_config", None) or config
    avoid = special_ids(config)
    text_ids = random_ids((batch, TEXT_LEN), text_config.vocab_size, avoid, generator).to(device)
    text = with_token_types(config, {"input_ids": text_ids, "use_cache": False})
    if not is_vlm(config):
        return ExampleInputs(text, None)
    if reason := unsupported(config, processor, model):
        return ExampleInputs(text, None, f"{reason}: its requests and checks are text-only")
    size = image_size or default_image_size(config)
    images = preprocess(
        config, [synthetic_image(size, generator) for _ in range(batch)], dtype, device, processor, model
    )
    # [text... , prefix, image tokens, suffix, text...], or the images first (IMAGES_FIRST)
    half = 0 if config.model_type in IMAGES_FIRST else TEXT_LEN // 2
    body = random_ids((batch, TEXT_LEN), text_config.vocab_size, avoid, generator)
    # a family without an image token: the places are ordinary ids its mask marks
    token = int(body[0, 0]) if image_mask.by_mask(config) else image_token_id(config)
    image_part = torch.tensor([images.placeholder(token, i) for i in range(batch)])
    ids = torch.cat([body[:, :half], image_part, body[:, half:]], dim=1).to(device)
    call = with_token_types(config, {"input_ids": ids, **images.kwargs, "use_cache": False})
    if image_mask.by_mask(config):  # [B, S]: 1 at each image place
        places = torch.zeros_like(ids)
        places[:, half : half + image_part.shape[1]] = 1
        call[image_mask.MASK] = places
    if model is not None and cross_attention.takes_vision_states(model):
        call[cross_attention.MASK] = torch.stack(
            [cross_attention_rows(config, row, images.kwargs, i) for i, row in enumerate(ids.tolist())]
        ).to(device)  # [B, S, 1, tiles]: the tiles each token attends
    if model is not None and "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        # what the family's processor returns beside the ids (1 marks an image token): Qwen2-VL's
        # model refuses image grids without it, Qwen2.5-VL's would count plain positions
        call["mm_token_type_ids"] = (ids == image_token_id(config)).int()
    if model is not None and vision_experts.routes(model):  # the image tokens go to the vision experts
        call[vision_experts.TYPES] = (ids == image_token_id(config)).int()
    return ExampleInputs(text, call)

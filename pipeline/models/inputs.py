"""Example inputs for export and the correctness check: token ids, and synthetic images for VLMs.

Each VLM family takes images in its own layout and expects a matching number of image placeholder
tokens in `input_ids`; `IMAGE_LAYOUTS` knows them. The images are synthetic (seeded noise already
in the model's pixel layout), so no image processor or hub file is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.errors import ConfigError

TEXT_LEN = 11  # prompt tokens around the image; odd, so no weight dimension shares the size


@dataclass
class ImageBatch:
    kwargs: dict[str, torch.Tensor]  # pixel tensors in the model's layout, e.g. pixel_values
    tokens_per_image: int
    prefix: list[int]  # token ids the family puts right before the image tokens
    suffix: list[int]


@dataclass
class ExampleInputs:
    text: dict[str, Any]  # kwargs of a text-only call of the whole model
    image: dict[str, Any] | None  # kwargs of a call with one image per sequence; None for text models


def _mistral3_images(config, batch: int, size: int, dtype, device, generator) -> ImageBatch:
    # pixel_values: [B, 3, H, W]; one image token per (patch * spatial_merge)^2 pixels.
    vision = config.vision_config
    step = vision.patch_size * config.spatial_merge_size
    if size % step:
        raise ConfigError(
            f"prompt.image_size={size} must be a multiple of {step} (patch * merge) for this model"
        )
    pixels = torch.randn(batch, vision.num_channels, size, size, generator=generator).to(device, dtype)
    sizes = torch.tensor([[size, size]] * batch, device=device)
    return ImageBatch({"pixel_values": pixels, "image_sizes": sizes}, (size // step) ** 2, [], [])


def _qwen2_5_vl_images(config, batch: int, size: int, dtype, device, generator) -> ImageBatch:
    # pixel_values: [B * h * w, C * T * P * P], flattened patches; image_grid_thw: [B, 3] = (1, h, w).
    vision = config.vision_config
    step = vision.patch_size * vision.spatial_merge_size
    if size % step:
        raise ConfigError(
            f"prompt.image_size={size} must be a multiple of {step} (patch * merge) for this model"
        )
    grid = size // vision.patch_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch * grid * grid, patch_dim, generator=generator).to(device, dtype)
    thw = torch.tensor([[1, grid, grid]] * batch, device=device)
    tokens = grid * grid // vision.spatial_merge_size**2
    # get_rope_index finds images by the vision-start token right before the image tokens.
    return ImageBatch(
        {"pixel_values": pixels, "image_grid_thw": thw},
        tokens,
        [config.vision_start_token_id],
        [config.vision_end_token_id],
    )


def _llama4_images(config, batch: int, size: int, dtype, device, generator) -> ImageBatch:
    # pixel_values: [B, 3, S, S], one tile per image at the vision tower's fixed size; the pixel
    # shuffle keeps ratio**2 of the (S / patch)**2 patches as image tokens.
    vision = config.vision_config
    if size != vision.image_size:
        raise ConfigError(
            f"prompt.image_size={size}: this model takes tiles of exactly {vision.image_size} pixels"
        )
    pixels = torch.randn(batch, vision.num_channels, size, size, generator=generator).to(device, dtype)
    tokens = int((size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)
    return ImageBatch({"pixel_values": pixels}, tokens, [config.boi_token_index], [config.eoi_token_index])


IMAGE_LAYOUTS: dict[str, Callable[..., ImageBatch]] = {
    "mistral3": _mistral3_images,
    "qwen2_5_vl": _qwen2_5_vl_images,
    "llama4": _llama4_images,
}


def default_image_size(config) -> int:
    vision = config.vision_config
    if config.model_type == "llama4":
        return vision.image_size
    merge = getattr(config, "spatial_merge_size", None) or vision.spatial_merge_size
    return 2 * vision.patch_size * merge  # 2 x 2 image tokens: the smallest image with structure


def image_token_id(config) -> int:
    return getattr(config, "image_token_index", None) or config.image_token_id


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
    layout = IMAGE_LAYOUTS.get(config.model_type)
    if layout is None:
        raise ConfigError(
            f"model_type={config.model_type} has no image layout; known: {', '.join(IMAGE_LAYOUTS)}"
        )
    images = layout(config, batch, image_size or default_image_size(config), dtype, device, generator)
    # [text... , prefix, image tokens, suffix, text...]
    half = TEXT_LEN // 2
    body = random_ids((batch, TEXT_LEN), text_config.vocab_size, avoid, generator)
    image_part = torch.tensor(
        images.prefix + [image_token_id(config)] * images.tokens_per_image + images.suffix
    ).expand(batch, -1)
    ids = torch.cat([body[:, :half], image_part, body[:, half:]], dim=1).to(device)
    return ExampleInputs(text, {"input_ids": ids, **images.kwargs, "use_cache": False})

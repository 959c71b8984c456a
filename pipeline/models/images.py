"""Images for VLMs: PIL images (local files, or seeded synthetic noise) through each family's
preprocessing into the model's pixel layout, with the number of image placeholder tokens it implies.

- mistral3: transformers' PixtralImageProcessor (built offline from its defaults, sized by the
  vision config): [N, 3, H, W] resized to multiples of patch * merge, plus image_sizes;
  one token per (patch * merge)^2 pixels.
- qwen2_5_vl: Qwen2VLImageProcessor: flattened patches [sum h*w, C*T*P*P] and image_grid_thw;
  h * w / merge^2 tokens, between the vision start and end tokens.
- llama4: one tile of the vision tower's size, rescaled and normalized with Llama-4's defaults
  (mean = std = 0.5), done here: its image processor needs torchvision, which does not install
  beside the CPU torch. (S / patch)^2 * pixel_shuffle_ratio^2 tokens, between BOI and EOI.
Nothing is fetched: a URL is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.errors import ConfigError


@dataclass
class ImageBatch:
    kwargs: dict[str, torch.Tensor]  # pixel tensors in the model's layout; dim 0 concatenates images
    tokens_per_image: list[int]
    prefix: list[int]  # token ids the family puts right before each image's tokens
    suffix: list[int]

    def placeholder(self, image_token: int, index: int) -> list[int]:
        return self.prefix + [image_token] * self.tokens_per_image[index] + self.suffix


def load_image(source: str) -> Image.Image:
    if "://" in source:
        raise ConfigError(f"image {source} is a URL; nothing can be fetched offline: use a local file")
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"image {source} does not exist")
    return Image.open(path).convert("RGB")


def synthetic_image(size: int, generator: torch.Generator) -> Image.Image:
    pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _processor_class(name: str) -> type:
    """The PIL flavour where this transformers has one: the default asks for torchvision."""
    import transformers

    return getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)


def _mistral3(config, images: list[Image.Image]) -> ImageBatch:
    processor_cls = _processor_class("PixtralImageProcessor")
    vision = config.vision_config
    step = vision.patch_size * config.spatial_merge_size
    processor = processor_cls(
        size={"longest_edge": vision.image_size}, patch_size={"height": step, "width": step}
    )
    out = processor(images=images, return_tensors="pt")
    sizes = out["image_sizes"]  # [N, 2] = (H, W) of each image inside the padded batch
    tokens = [int(h // step) * int(w // step) for h, w in sizes.tolist()]
    return ImageBatch({"pixel_values": out["pixel_values"], "image_sizes": sizes}, tokens, [], [])


def _qwen2_5_vl(config, images: list[Image.Image]) -> ImageBatch:
    processor_cls = _processor_class("Qwen2VLImageProcessor")
    vision = config.vision_config
    step = vision.patch_size * vision.spatial_merge_size
    processor = processor_cls(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        min_pixels=step * step,
        max_pixels=max(img.width * img.height for img in images) + step * step,  # keep the given size
    )
    out = processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]  # [N, 3] = (t, h, w) in patches
    tokens = [int(t * h * w) // vision.spatial_merge_size**2 for t, h, w in grid.tolist()]
    return ImageBatch(
        {"pixel_values": out["pixel_values"], "image_grid_thw": grid},
        tokens,
        [config.vision_start_token_id],
        [config.vision_end_token_id],
    )


def _llama4(config, images: list[Image.Image]) -> ImageBatch:
    vision = config.vision_config
    size = vision.image_size
    tiles = [np.asarray(img.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0 for img in images]
    pixels = (torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2) - 0.5) / 0.5  # [N, 3, S, S]
    tokens = int((size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)
    return ImageBatch(
        {"pixel_values": pixels}, [tokens] * len(images), [config.boi_token_index], [config.eoi_token_index]
    )


PREPROCESS: dict[str, Callable[..., ImageBatch]] = {
    "mistral3": _mistral3,
    "qwen2_5_vl": _qwen2_5_vl,
    "llama4": _llama4,
}


def default_image_size(config) -> int:
    vision = config.vision_config
    if config.model_type == "llama4":
        return vision.image_size
    merge = getattr(config, "spatial_merge_size", None) or vision.spatial_merge_size
    return 2 * vision.patch_size * merge  # 2 x 2 image tokens: the smallest image with structure


def image_token_id(config) -> int:
    return getattr(config, "image_token_index", None) or config.image_token_id


def preprocess(config, images: list[Image.Image], dtype: torch.dtype, device: torch.device) -> ImageBatch:
    family = PREPROCESS.get(config.model_type)
    if family is None:
        raise ConfigError(
            f"model_type={config.model_type} has no image preprocessing; known: {', '.join(PREPROCESS)}"
        )
    batch = family(config, images)
    batch.kwargs = {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.kwargs.items()
    }
    return batch


def concat_pixels(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Images of several requests in one call: concatenated along dim 0; image tensors of different
    sizes ([N, 3, H, W]) are zero-padded to the largest, as the processors pad a batch (the model
    crops by image_sizes)."""
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        tensors = [p[key] for p in parts if key in p]
        if tensors[0].dim() == 4:
            height, width = max(t.shape[2] for t in tensors), max(t.shape[3] for t in tensors)
            tensors = [
                torch.nn.functional.pad(t, (0, width - t.shape[3], 0, height - t.shape[2])) for t in tensors
            ]
        out[key] = torch.cat(tensors)
    return out

"""Images for VLMs: PIL images (local files, or seeded synthetic noise) through each family's
preprocessing into the model's pixel layout, with the image tokens the family's processor puts in
a prompt for each.

The image processor is the checkpoint's own (its preprocessor_config.json) when there is one, else
built from the vision config's sizes. The processors themselves (Pixtral's, Qwen2.5-VL's with its
video half, Llama-4's) need torchvision, which does not install beside the CPU torch, so their
token rules are written here, each checked against the model's own image-token count:
- mistral3: PixtralImageProcessor (the PIL flavour): [N, 3, H, W] resized to multiples of
  patch * merge, plus image_sizes; per image (H / step) rows of (W / step) `[IMG]` tokens, each
  row ended by `[IMG_BREAK]` and the last by `[IMG_END]` (PixtralProcessor's layout).
- qwen2_5_vl: Qwen2VLImageProcessor (PIL): flattened patches [sum h*w, C*T*P*P] and image_grid_thw;
  `<|image_pad|>` repeated h * w / merge^2 times, between the vision start and end tokens.
- llama4: one tile of the vision tower's size, rescaled and normalized with Llama-4's defaults
  (mean = std = 0.5), done here: its image processor is torchvision-only.
  `<|image_start|><|image|>` + (S / patch)^2 * pixel_shuffle_ratio^2 `<|patch|>` + `<|image_end|>`
  (Llama4Processor's single-tile layout).
Every other VLM (LLaVA, Gemma 3, PaliGemma, ...) needs no code here: its image processor class in
transformers (PIL flavour) sized by the vision config's `image_size`, and the token count asked of
the model (`get_image_features` on the meta-device skeleton); `[boi] image*n [eoi]` where the
config has begin/end-of-image ids. A family whose images cannot be prepared (`unsupported`) runs
text-only requests.
Nothing is fetched: a URL is refused.
"""

from __future__ import annotations

import json
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
    grids: list[tuple[int, int]]  # per image, the (rows, columns) of its image tokens

    def placeholder(self, image_token: int, index: int) -> list[int]:
        return self.prefix + [image_token] * self.tokens_per_image[index] + self.suffix


def load_image(source: str) -> Image.Image:
    if "://" in source and not source.startswith("file://"):
        raise ConfigError(f"image {source} is a URL; nothing can be fetched offline: use a local file")
    path = Path(source.removeprefix("file://"))
    if not path.is_file():
        raise ConfigError(f"image {source} does not exist")
    return Image.open(path).convert("RGB")


def synthetic_image(size: int, generator: torch.Generator) -> Image.Image:
    pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _processor_class(name: str) -> type:
    """The PIL flavour where this transformers has one: the default asks for torchvision."""
    import transformers

    name = name.removesuffix("Pil")
    return getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)


def checkpoint_image_processor(checkpoint: str | None):
    """The image processor a model folder saved (preprocessor_config.json), or None."""
    path = Path(checkpoint or "") / "preprocessor_config.json"
    if not checkpoint or not path.is_file():
        return None
    name = json.loads(path.read_text()).get("image_processor_type")
    if not name:
        return None
    return _processor_class(name).from_pretrained(checkpoint, local_files_only=True)


def _mistral3(config, images: list[Image.Image], processor) -> ImageBatch:
    vision = config.vision_config
    step = vision.patch_size * config.spatial_merge_size
    processor = processor or _processor_class("PixtralImageProcessor")(
        size={"longest_edge": vision.image_size}, patch_size={"height": step, "width": step}
    )
    out = processor(images=images, return_tensors="pt")
    sizes = out["image_sizes"]  # [N, 2] = (H, W) of each image inside the padded batch
    grids = [(int(h // step), int(w // step)) for h, w in sizes.tolist()]
    return ImageBatch(
        {"pixel_values": out["pixel_values"], "image_sizes": sizes}, [h * w for h, w in grids], [], [], grids
    )


def _qwen2_5_vl(config, images: list[Image.Image], processor) -> ImageBatch:
    vision = config.vision_config
    step = vision.patch_size * vision.spatial_merge_size
    processor = processor or _processor_class("Qwen2VLImageProcessor")(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        min_pixels=step * step,
        max_pixels=max(img.width * img.height for img in images) + step * step,  # keep the given size
    )
    out = processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]  # [N, 3] = (t, h, w) in patches
    merge = vision.spatial_merge_size
    grids = [(int(t * h) // merge, int(w) // merge) for t, h, w in grid.tolist()]
    return ImageBatch(
        {"pixel_values": out["pixel_values"], "image_grid_thw": grid},
        [h * w for h, w in grids],
        [config.vision_start_token_id],
        [config.vision_end_token_id],
        grids,
    )


def _llama4(config, images: list[Image.Image], processor) -> ImageBatch:
    vision = config.vision_config
    size = vision.image_size
    tiles = [np.asarray(img.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0 for img in images]
    pixels = (torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2) - 0.5) / 0.5  # [N, 3, S, S]
    side = int(size // vision.patch_size * vision.pixel_shuffle_ratio)
    return ImageBatch(
        {"pixel_values": pixels},
        [side * side] * len(images),
        [config.boi_token_index],
        [config.eoi_token_index],
        [(side, side)] * len(images),
    )


# Families whose image size (and so token count) follows the image: their processors' own rules,
# measured necessary (a fixed-size image processor would not exercise what the model does). Every
# other VLM goes through `_fixed_size`.
PREPROCESS: dict[str, Callable[..., ImageBatch]] = {
    "mistral3": _mistral3,
    "qwen2_5_vl": _qwen2_5_vl,
    "llama4": _llama4,
}
# Families whose processor puts the images before the text (the prefix PaliGemma attends both ways).
IMAGES_FIRST = ("paligemma",)


def image_processor_class(model_type: str) -> type | None:
    """The family's image processor in transformers (the PIL flavour), or None."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
    name = names.get("pil") if isinstance(names, dict) else next((n for n in names if n), None)
    return getattr(transformers, name, None) if name else None


def unsupported(config, processor=None, model=None) -> str | None:
    """Why this VLM's images cannot be prepared here, or None when they can: a family written here,
    or the checkpoint's image processor or the family's in transformers, with a model to ask for the
    image token count."""
    if config.model_type in PREPROCESS:
        return None
    if processor is None and image_processor_class(config.model_type) is None:
        return (
            f"model_type={config.model_type} has no image processor in transformers and the checkpoint none"
        )
    if model is not None and not hasattr(model, "get_image_features"):
        return f"{type(model).__name__} has no get_image_features to count an image's tokens"
    return None


def sized_processor(config):
    """The family's image processor built with the vision config's image size: every size its
    defaults name (height and width, or a shortest edge and a center crop) set to that size."""
    processor_cls = image_processor_class(config.model_type)
    side = config.vision_config.image_size
    defaults = processor_cls()
    kwargs = {}
    size = getattr(defaults, "size", None)
    if getattr(size, "height", None) is not None:
        kwargs["size"] = {"height": side, "width": side}
    elif getattr(size, "shortest_edge", None) is not None:
        kwargs["size"] = {"shortest_edge": side}
    if getattr(getattr(defaults, "crop_size", None), "height", None) is not None:
        kwargs["crop_size"] = {"height": side, "width": side}
    return processor_cls(**kwargs)


def image_tokens(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> list[int]:
    """How many tokens each image becomes, asked of the model itself: its get_image_features on
    the meta device (no memory, no compute), as many rows as the language model receives."""
    with torch.no_grad():
        out = model.get_image_features(**{k: v.to("meta") for k, v in pixels.items()})
    features = getattr(out, "pooler_output", out)
    if isinstance(features, list | tuple):
        return [int(f.shape[0]) for f in features]
    return [int(features.shape[1])] * int(features.shape[0])


def _fixed_size(config, images: list[Image.Image], processor, model) -> ImageBatch:
    """Any other VLM: its own image processor (the checkpoint's, or the family's sized by the vision
    config), the token count from the model; `[boi] image... [eoi]` where the config has them."""
    processor = processor or sized_processor(config)
    out = processor(images=images, return_tensors="pt")
    pixels = {"pixel_values": out["pixel_values"]}
    if model is None:
        raise ValueError(f"{config.model_type}: the image token count needs the model (meta-device) to ask")
    counts = image_tokens(model, pixels)
    prefix = [config.boi_token_index] if isinstance(getattr(config, "boi_token_index", None), int) else []
    suffix = [config.eoi_token_index] if isinstance(getattr(config, "eoi_token_index", None), int) else []
    return ImageBatch(pixels, counts, prefix, suffix, [(1, n) for n in counts])


def default_image_size(config) -> int:
    vision = config.vision_config
    if config.model_type not in PREPROCESS or config.model_type == "llama4":
        return getattr(vision, "image_size", None) or 224  # resized by the processor anyway
    merge = getattr(config, "spatial_merge_size", None) or vision.spatial_merge_size
    return 2 * vision.patch_size * merge  # 2 x 2 image tokens: the smallest image with structure


def image_token_id(config) -> int:
    return getattr(config, "image_token_index", None) or config.image_token_id


def preprocess(
    config, images: list[Image.Image], dtype: torch.dtype, device: torch.device, processor=None, model=None
) -> ImageBatch:
    """processor: the checkpoint's image processor (checkpoint_image_processor), else the family's
    built from the vision config. model: one of the architecture (the meta-device one serves),
    which counts the tokens of a fixed-size family's images."""
    if reason := unsupported(config, processor, model):
        raise ConfigError(f"{reason}: images cannot be given to it here; use text-only queries")
    family = PREPROCESS.get(config.model_type)
    batch = family(config, images, processor) if family else _fixed_size(config, images, processor, model)
    batch.kwargs = {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.kwargs.items()
    }
    return batch


# The token a chat template writes for an image, which the family's processor expands; others write
# the begin-of-image token where the config has one (Gemma 3), else the image token itself (LLaVA).
TEMPLATE_IMAGE_TOKEN = {"mistral3": "[IMG]", "qwen2_5_vl": "<|image_pad|>", "llama4": "<|image|>"}


def chat_placeholder(config, tokenizer) -> int:
    """The id of the token the chat template puts where an image goes."""
    if config.model_type in TEMPLATE_IMAGE_TOKEN:
        return tokenizer.convert_tokens_to_ids(TEMPLATE_IMAGE_TOKEN[config.model_type])
    boi = getattr(config, "boi_token_index", None)
    return boi if isinstance(boi, int) else image_token_id(config)


def expand(config, tokenizer, batch: ImageBatch, index: int) -> list[int]:
    """What the family's processor puts in place of the chat template's image token for image `index`."""
    ids = tokenizer.convert_tokens_to_ids
    image = image_token_id(config)
    rows, columns = batch.grids[index]
    if config.model_type == "mistral3":
        tokens = [t for _ in range(rows) for t in [image] * columns + [ids("[IMG_BREAK]")]]
        tokens[-1] = ids("[IMG_END]")
        return tokens
    if config.model_type == "qwen2_5_vl":  # the template writes the vision start and end around it
        return [image] * (rows * columns)
    if config.model_type == "llama4":
        return [ids("<|image_start|>"), ids("<|image|>"), *[image] * (rows * columns), ids("<|image_end|>")]
    return batch.placeholder(image, index)  # [boi] image... [eoi]


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

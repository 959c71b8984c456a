"""Images for VLMs: PIL images (local files, or seeded synthetic noise) through each family's
preprocessing into the model's pixel layout, with the image tokens the family's processor puts in
a prompt for each.

The image processor is the checkpoint's own (its preprocessor_config.json) when there is one, else
built from the vision config's sizes (an int, [height, width] or a dict, whichever the config
gives). A request made without the family's Processor (a model YAML, or a folder with only an
image processor; with one, models/processor.py makes the request) takes the layout written here
for the families whose image size and token count follow the image, keyed by the processor a model
type maps to in transformers, each checked against the model's own image-token count:
- mistral3: PixtralImageProcessor (the PIL flavour): [N, 3, H, W] resized to multiples of
  patch * merge, plus image_sizes; per image (H / step) rows of (W / step) `[IMG]` tokens, each
  row ended by `[IMG_BREAK]` and the last by `[IMG_END]` (PixtralProcessor's layout).
- qwen2_vl, qwen2_5_vl: Qwen2VLImageProcessor (PIL): flattened patches [sum h*w, C*T*P*P] and image_grid_thw;
  `<|image_pad|>` repeated h * w / merge^2 times, between the vision start and end tokens.
- llama4: one tile of the vision tower's size, rescaled and normalized with Llama-4's defaults
  (mean = std = 0.5), done here: its image processor is torchvision-only (a torch without
  torchvision has none).
  `<|image_start|><|image|>` + (S / patch)^2 * pixel_shuffle_ratio^2 `<|patch|>` + `<|image_end|>`
  (Llama4Processor's single-tile layout).
Every other VLM (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Gemma 3, PaliGemma, Idefics3, SmolVLM,
InternVL, Aya Vision, GLM-4V, ...) needs no code here: its image processor class in transformers
(PIL flavour) sized by the vision config (one that merges patches, GLM-4V's, takes the config's
patch and merge sizes and keeps its pixel budget), each
image processed alone, every tensor it returns that the model's forward names passed on
(`image_sizes`, `pixel_attention_mask`, ...), and the token count asked of the model
(`get_image_features` run for real: on a copy of the meta-device skeleton whose vision parts get
memory, no meta tensor through any model); `[boi] image*n [eoi]` where
the config has begin/end-of-image ids. A family whose language model cross-attends the vision
states (Mllama) has one image token per image (models/cross_attention.py). A family whose images cannot be prepared (`unsupported`)
is refused up front for an image request.
Nothing is fetched: a URL is refused.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.errors import ConfigError
from pipeline.models import cross_attention, image_mask, vq_codes


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
    """The image processor a model folder saved (preprocessor_config.json), or None: as
    AutoImageProcessor loads it (torchvision's flavour where torchvision imports, as Hugging Face
    takes it, so the pixels are the ones its processor makes)."""
    path = Path(checkpoint or "") / "preprocessor_config.json"
    if not checkpoint or not path.is_file() or not json.loads(path.read_text()).get("image_processor_type"):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(checkpoint, local_files_only=True)


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


def _fuyu(config, images: list[Image.Image], processor) -> ImageBatch:
    """No vision tower: each image's patches, flattened, are what the model embeds ([patches,
    patch * patch * channels]), cut as FuyuProcessor cuts them from the unpadded image."""
    patch = config.patch_size
    processor = processor or _processor_class("FuyuImageProcessor")(
        patch_size={"height": patch, "width": patch}
    )
    rows, grids = [], []
    for image in images:
        out = processor(images=[image], return_tensors="pt")
        height = -(-int(out["image_unpadded_heights"][0][0]) // patch) * patch  # whole patches
        width = -(-int(out["image_unpadded_widths"][0][0]) // patch) * patch
        pixels = torch.as_tensor(out["images"][0][0])[:, :height, :width]  # [C, H, W] inside the canvas
        channels = pixels.shape[0]
        # [C, H/p, W/p, p, p] -> [patches, p, p, C] -> [patches, p * p * C], row by row, as its unfold
        tiles = pixels.unfold(1, patch, patch).unfold(2, patch, patch).reshape(channels, -1, patch, patch)
        rows.append(tiles.permute(1, 2, 3, 0).reshape(-1, patch * patch * channels))
        grids.append((height // patch, width // patch))
    return ImageBatch({"pixel_values": torch.cat(rows)}, [h * w for h, w in grids], [], [], grids)


# Image processors whose image size (and so token count) follows the image: their rules, for a
# request made without the family's Processor, keyed by the processor a model type maps to in
# transformers, not by the model type (Qwen2-VL and Qwen2.5-VL share one); each gives inputs the
# generic path does not (tests/test_images.py shows how). Every other VLM goes through `_fixed_size`.
PREPROCESS: dict[str, Callable[..., ImageBatch]] = {
    "PixtralImageProcessor": _mistral3,
    "Qwen2VLImageProcessor": _qwen2_5_vl,
    "Llama4ImageProcessor": _llama4,
    "FuyuImageProcessor": _fuyu,
}
# Families whose processor puts the images before the text (the prefix PaliGemma attends both ways;
# Fuyu's processor puts its one image first).
IMAGES_FIRST = ("paligemma", "fuyu")


def _image_processor_names(model_type: str):
    """transformers' image processor names for the model type; for a type it maps none to, those
    of a type sharing its Processor class (Qwen3-VL-MoE's are Qwen3-VL's, GLM-4.5V's GLM-4V's)."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    if names := IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type):
        return names
    processor = PROCESSOR_MAPPING_NAMES.get(model_type)
    sharing = (
        t for t, p in PROCESSOR_MAPPING_NAMES.items() if processor and p == processor and t != model_type
    )
    return next(
        (IMAGE_PROCESSOR_MAPPING_NAMES[t] for t in sharing if IMAGE_PROCESSOR_MAPPING_NAMES.get(t)), {}
    )


def processor_name(model_type: str) -> str | None:
    """The name of the image processor transformers maps the model type to, without its flavour."""
    names = _image_processor_names(model_type)
    name = next((n for n in (names.values() if isinstance(names, dict) else names) if n), None)
    return name.removesuffix("Pil") if name else None


def rule_of(config) -> str | None:
    """The PREPROCESS key of a config's images, or None for the fixed-size path."""
    name = processor_name(config.model_type)
    return name if name in PREPROCESS else None


def image_processor_class(model_type: str) -> type | None:
    """The family's image processor in transformers (the PIL flavour; the torchvision one for a
    family that has no other, Llama 4's), or None."""
    import transformers
    from transformers.utils import is_torchvision_available

    names = _image_processor_names(model_type)
    if isinstance(names, dict):
        name = names.get("pil") or (names.get("torchvision") if is_torchvision_available() else None)
    else:
        name = next((n for n in names if n), None)
    return getattr(transformers, name, None) if name else None


def unsupported(config, processor=None, model=None) -> str | None:
    """Why this VLM's images cannot be prepared here, or None when they can: a family written here,
    or the checkpoint's image processor or the family's in transformers, with a model to ask for the
    image token count."""
    if rule_of(config):
        return None
    if processor is None and image_processor_class(config.model_type) is None:
        return (
            f"model_type={config.model_type} has no image processor in transformers and the checkpoint "
            "none (a model.checkpoint folder with its preprocessor_config.json brings one)"
        )
    if processor is None and encoder_config(config) is None:
        return (
            f"model_type={config.model_type} takes images but has no vision_config (nor vq_config) to size them by "
            "(a model.checkpoint folder with its preprocessor_config.json brings its image processor)"
        )
    if model is not None and featurer(model) is None and not cross_attention.takes_vision_states(model):
        return (
            f"{type(model).__name__} has no get_image_features and takes no cross_attention_states: "
            "how its images reach the language model is not known here"
        )
    return None


def size_pair(value) -> tuple[int, int] | None:
    """(height, width) of a size as configs give it: an int, [h, w], or a dict of height and width
    (or of one edge); None when absent (a variable-resolution family)."""
    if value is None:
        return None
    if isinstance(value, int):
        return value, value
    if isinstance(value, list | tuple) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, dict):
        if "height" in value and "width" in value:
            return int(value["height"]), int(value["width"])
        edge = value.get("shortest_edge") or value.get("longest_edge")
        if edge:
            return int(edge), int(edge)
    raise ValueError(f"an image size of {value!r}: expected an int, [height, width] or a dict of them")


# The size keys image processors take, each as it follows from the vision config's (height, width)
_SIZE_KEYS = {
    "height": lambda h, w: h,
    "width": lambda h, w: w,
    "shortest_edge": lambda h, w: min(h, w),
    "longest_edge": lambda h, w: max(h, w),
}


def _keys_of(size) -> list[str]:
    get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    return [key for key in _SIZE_KEYS if get(key) is not None]


# Patch settings a variable-resolution processor takes, each read from the vision config's
_PATCH_KEYS = {
    "patch_size": "patch_size",
    "merge_size": "spatial_merge_size",
    "temporal_patch_size": "temporal_patch_size",
}


# Tile settings a tiling processor takes, each read from the vision config's
_TILE_KEYS = {"max_image_tiles": "max_num_tiles"}


def sized_processor(config):
    """The family's image processor built with the vision config's sizes. A processor that merges
    patches (GLM-4V's, variable resolution) resizes each image to multiples of patch * merge within
    a pixel budget (its `size` edges are pixel counts): its patch, merge and temporal settings come
    from the vision config, its budget stays. A tiling one cuts at most the vision config's tiles.
    Any other has every size key its defaults name (height
    and width, a shortest or longest edge, a center crop, a tile size) set from the vision config's
    image size (an edge given as a number too), and a second tower's size keys (`high_res_size`)
    from its own config; the processor's defaults where the config gives no size."""
    processor_cls = image_processor_class(config.model_type)
    vision = encoder_config(config)
    defaults = processor_cls()
    if getattr(defaults, "merge_size", None) is not None:
        kwargs = {key: getattr(vision, name) for key, name in _PATCH_KEYS.items() if hasattr(vision, name)}
        return processor_cls(**kwargs)
    # a tiling processor cuts at most as many tiles as the vision tower embeds (Mllama's)
    kwargs = {key: getattr(vision, name) for key, name in _TILE_KEYS.items() if hasattr(defaults, key)}
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    hw = encoder_size(vision)
    if hw is None:
        return processor_cls(**kwargs) if kwargs else defaults
    for name in ("size", "crop_size", "max_image_size"):
        if keys := _keys_of(getattr(defaults, name, None)):
            kwargs[name] = {key: _SIZE_KEYS[key](*hw) for key in keys}
    # one edge as a number (Aria's: every image resized to it, its smallest no larger)
    if isinstance(getattr(defaults, "max_image_size", None), int):
        kwargs["max_image_size"] = max(hw)
        if isinstance(getattr(defaults, "min_image_size", None), int):
            kwargs["min_image_size"] = min(defaults.min_image_size, max(hw))
    # every other tower's size from its own config: `<branch>_vision_config` sizes `<branch>_size`
    # (DeepSeek-VL hybrid's high-resolution SAM encoder)
    for name, branch in vars(config).items():
        key = name.removesuffix("_vision_config") + "_size"
        if name.endswith("_vision_config") and (keys := _keys_of(getattr(defaults, key, None))):
            if branch_hw := size_pair(getattr(branch, "image_size", None)):
                kwargs[key] = {k: _SIZE_KEYS[k](*branch_hw) for k in keys}
    return processor_cls(**kwargs)


def taken(function, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a function's signature names (a **kwargs catch-all takes none: what a processor
    returns for itself, Gemma 3's num_crops, would reach the language model)."""
    parameters = inspect.signature(function).parameters
    return {k: v for k, v in tensors.items() if k in parameters}


def image_tokens(model: torch.nn.Module, pixels: dict[str, torch.Tensor], images: int) -> list[int]:
    """How many tokens each of `images` images becomes, asked of the model itself: its
    get_image_features run for real, as many rows as the language model receives. A model of
    real weights runs as it is; the meta-device skeleton, which no tensor can run through, on a
    copy whose parts outside the language model get memory (`_counter`). Where the features come
    per tile, not per image (Idefics3 splits an image into tiles), each image is asked alone and
    its tiles summed."""
    counts = _image_tokens(model, pixels)
    if len(counts) == images:
        return counts
    return [
        sum(_image_tokens(model, {k: v[i : i + 1] if v.shape[0] == images else v for k, v in pixels.items()}))
        for i in range(images)
    ]


def featurer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose get_image_features embeds images: the model's own, or its inner model's
    (DeepSeek-VL's outer class has none); None where images become no prompt tokens."""
    for module in (model, getattr(model, "model", None)):
        if isinstance(module, torch.nn.Module) and hasattr(module, "get_image_features"):
            return module
    return None


def _featuring(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> tuple[str, dict]:
    """Which of the model and its inner model to ask (its attribute path), and what to pass: the
    first whose get_image_features gets every argument it requires from the pixel tensors
    (Video-LLaVA's outer one requires `pixel_values`, its inner one takes the processor's
    `pixel_values_images`)."""
    for path in ("", "model"):
        module = model.get_submodule(path) if path else model
        if not hasattr(module, "get_image_features"):
            continue
        call = taken(module.get_image_features, pixels)
        required = {
            name
            for name, p in inspect.signature(module.get_image_features).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }
        if call and required <= set(call):
            return path, call
    return "", taken(featurer(model).get_image_features, pixels)


def _image_tokens(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> list[int]:
    path, call = _featuring(model, pixels)
    if any(p.is_meta for p in model.parameters()):
        if model not in _COUNTERS:
            _COUNTERS[model] = _counter(model)
        model, call = _COUNTERS[model], {k: v.cpu() for k, v in call.items()}
    module = model.get_submodule(path) if path else model
    with torch.no_grad():
        return _counts(module.get_image_features(**call))


def _counts(out) -> list[int]:
    """Tokens per image of get_image_features' output: a list of [tokens, hidden], a batch
    [images, tokens, hidden], or every image's rows at once [tokens, hidden] (Fuyu's patches, one
    image a prompt; its output keeps them as last_hidden_state)."""
    features = getattr(out, "pooler_output", None)
    if features is None:
        features = getattr(out, "last_hidden_state", out)
    if isinstance(features, list | tuple):
        return [int(f.shape[0]) for f in features]
    if features.dim() == 2:
        return [int(features.shape[0])]
    return [int(features.shape[1])] * int(features.shape[0])


# meta-device model -> its copy with memory outside the language model: made once, every later
# image counted on it
_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _counter(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the meta-device model whose parts outside the decoder stack and the lm_head get
    zeroed memory on CPU: the token count follows the shapes and the pixels, not the weights."""
    import copy

    from pipeline.graphs import find_language_models

    counter = copy.deepcopy(model)
    text_config = getattr(counter.config, "text_config", None) or counter.config
    skipped = find_language_models(counter, text_config)
    head = counter.get_output_embeddings() if hasattr(counter, "get_output_embeddings") else None
    for path, module in counter.named_modules():
        if module is head or any(path == p or path.startswith(p + ".") for p in skipped):
            continue
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    table[name] = torch.zeros_like(tensor, device="cpu")
    return counter


def _fixed_size(config, images: list[Image.Image], processor, model) -> ImageBatch:
    """Any other VLM: its own image processor (the checkpoint's, or the family's sized by the vision
    config), every tensor it returns that the model's forward takes, the token count from the
    model; `[boi] image... [eoi]` where the config has them."""
    processor = processor or sized_processor(config)
    if model is None:
        raise ValueError(f"{config.model_type}: the image token count needs the model (meta-device) to ask")
    # One image a call: a processor that takes a list as one sample's images (Idefics3) then gives
    # dim 0 per image too.
    outs = [processor(images=[image], return_tensors="pt") for image in images]
    tensors = concat_pixels([{k: v for k, v in out.items() if isinstance(v, torch.Tensor)} for out in outs])
    pixels = taken(model.forward, tensors)
    if cross_attention.takes_vision_states(model):  # one token an image (models/cross_attention.py)
        counts = [1] * len(images)
    elif codes := vq_codes.tokens_per_image(config):  # its VQ config's count (models/vq_codes.py)
        counts = [codes] * len(images)
    else:
        counts = image_tokens(model, pixels, len(images))
    prefix = [config.boi_token_index] if isinstance(getattr(config, "boi_token_index", None), int) else []
    suffix = [config.eoi_token_index] if isinstance(getattr(config, "eoi_token_index", None), int) else []
    return ImageBatch(pixels, counts, prefix, suffix, [(1, n) for n in counts])


def patch_of(config) -> int | None:
    """The image patch's side in pixels: the vision tower's, or the model's own where it embeds
    patches itself (Fuyu's, no vision_config); None where the config names none."""
    patch = size_pair(getattr(getattr(config, "vision_config", None) or config, "patch_size", None))
    return patch[0] if patch else None


def encoder_config(config):
    """The config of what turns images into the language model's input: the vision tower's, or the
    VQ-GAN's of a family whose images become vocabulary ids (Chameleon's); None for neither."""
    return getattr(config, "vision_config", None) or getattr(config, "vq_config", None)


def encoder_size(encoder) -> tuple[int, int] | None:
    """(height, width) of the images an encoder config takes: a vision tower's image_size, a
    VQ-GAN's resolution; None where it names none."""
    return size_pair(getattr(encoder, "image_size", None) or getattr(encoder, "resolution", None))


def default_image_size(config) -> int:
    vision = encoder_config(config)
    patch = patch_of(config)
    if vision is None:
        # patches the model embeds itself (Fuyu's): 2 x 2 of them; else a checkpoint's processor resizes it
        return 2 * patch if patch else 224
    hw = encoder_size(vision)
    if hw is not None and rule_of(config) in (None, "Llama4ImageProcessor"):
        return max(hw)  # resized by the processor anyway
    if patch is None:
        return 224
    merge = getattr(config, "spatial_merge_size", None) or getattr(vision, "spatial_merge_size", None) or 1
    return 2 * patch * merge  # 2 x 2 image tokens: the smallest image with structure


def image_token_id(config) -> int | None:
    """The id the config gives the image token (image_token_index or image_token_id), else None."""
    index = getattr(config, "image_token_index", None)
    return index if index is not None else getattr(config, "image_token_id", None)


def check_image_token(config) -> None:
    """A VLM's image features go where its config's image token sits, in every request and in
    export's image call, or where its processor's mask marks them (models/image_mask.py). A family
    with neither is refused before load."""
    if image_token_id(config) is None and not image_mask.by_mask(config):
        raise ConfigError(
            f"model_type={config.model_type} names no image token (image_token_index or image_token_id) and "
            f"is not a family whose processor marks image positions by a mask ({', '.join(image_mask.FAMILIES)}): "
            "where its image features go is not known here"
        )


def preprocess(
    config, images: list[Image.Image], dtype: torch.dtype, device: torch.device, processor=None, model=None
) -> ImageBatch:
    """processor: the checkpoint's image processor (checkpoint_image_processor), else the family's
    built from the vision config. model: one of the architecture (the meta-device one serves),
    which counts the tokens of a fixed-size family's images."""
    if reason := unsupported(config, processor, model):
        raise ConfigError(f"{reason}: its requests cannot carry images here; give text-only prompt.queries")
    rule = rule_of(config)
    batch = (
        PREPROCESS[rule](config, images, processor) if rule else _fixed_size(config, images, processor, model)
    )
    batch.kwargs = {
        k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.kwargs.items()
    }
    return batch


# The token a chat template writes for an image, which the family's processor expands; others write
# the begin-of-image token where the config has one (Gemma 3), else the image token itself (LLaVA).
TEMPLATE_IMAGE_TOKEN = {
    "PixtralImageProcessor": "[IMG]",
    "Qwen2VLImageProcessor": "<|image_pad|>",
    "Llama4ImageProcessor": "<|image|>",
    "FuyuImageProcessor": "|SPEAKER|",
}


def chat_placeholder(config, tokenizer) -> int:
    """The id of the token the chat template puts where an image goes."""
    if rule := rule_of(config):
        return tokenizer.convert_tokens_to_ids(TEMPLATE_IMAGE_TOKEN[rule])
    boi = getattr(config, "boi_token_index", None)
    return boi if isinstance(boi, int) else image_token_id(config)


def expand(config, tokenizer, batch: ImageBatch, index: int) -> list[int]:
    """What the family's processor puts in place of the chat template's image token for image `index`."""
    ids = tokenizer.convert_tokens_to_ids
    image = image_token_id(config)
    rows, columns = batch.grids[index]
    rule = rule_of(config)
    if rule == "PixtralImageProcessor":
        tokens = [t for _ in range(rows) for t in [image] * columns + [ids("[IMG_BREAK]")]]
        tokens[-1] = ids("[IMG_END]")
        return tokens
    if rule == "Qwen2VLImageProcessor":  # the template writes the vision start and end around it
        return [image] * (rows * columns)
    if rule == "Llama4ImageProcessor":
        return [ids("<|image_start|>"), ids("<|image|>"), *[image] * (rows * columns), ids("<|image_end|>")]
    return batch.placeholder(image, index)  # [boi] image... [eoi]


def concat_pixels(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Images of several requests in one call: concatenated along dim 0; tensors whose other dims
    differ ([N, 3, H, W] of different sizes, [N, tiles, ...] of different tile counts) are
    zero-padded at the end of each to the largest, as the processors pad a batch (the model crops
    by image_sizes, or skips what a pixel mask leaves out). A 0-dim tensor (a processor's count
    for the whole call) is passed once, where every request gives the same value."""
    out = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        tensors = [p[key] for p in parts if key in p]
        if tensors[0].dim() == 0:
            if any(not torch.equal(t, tensors[0]) for t in tensors):
                raise ValueError(
                    f"{key}: the requests of one step give it different values "
                    f"({sorted({t.item() for t in tensors})}); it is one value for the whole call"
                )
            out[key] = tensors[0]
            continue
        largest = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
        padded = []
        for t in tensors:
            widths = [w for d in reversed(range(1, t.dim())) for w in (0, largest[d - 1] - t.shape[d])]
            padded.append(torch.nn.functional.pad(t, widths) if any(widths) else t)
        out[key] = torch.cat(padded)
    return out

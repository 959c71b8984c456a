"""The family's own processor, loaded from a checkpoint folder as `AutoProcessor.from_pretrained`
loads it, and the source of truth for a chat request with images: its ids, its pixel tensors and
its per-token tensors reach the model as it returned them (Idefics3's tiles with their row and
column tokens, GOT-OCR2's `<img>` ... `</img>`, Gemma 3's blank lines around an image).

A folder has a processor when it holds `processor_config.json` or `preprocessor_config.json` beside
its tokenizer. Where it cannot be built here (a video half that needs torchvision, under the CPU
build of torch; transformers refuses a Processor without its video half), the log says so at
WARNING and chat images are laid out by models/images.py's rules.

What a processor returns, each output by what the model does with it:
- pixel tensors (one row per image or tile, or 0-dim): a request's `images`, passed to the forward
  in the step that holds the images, when the forward names them;
- per-token tensors (`PER_TOKEN`, [1, S] beside the ids): a request's `token_inputs`, which the
  runtime gives the model at every step (runtime/executors.py, runtime/positions.py);
- `labels` (PaliGemma's processor returns them beside its token types): the loss's targets, which
  no logit depends on, left out of generation with a one-line note;
- any other per-token output the forward names is refused before load: the captured language
  model takes ids, positions and its cache, nothing else per token.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

from pipeline.errors import ConfigError, StageFailure
from pipeline.models import cross_attention, image_mask, masks, vision_experts
from pipeline.models import images as imaging

log = logging.getLogger(__name__)

# Per-token outputs the runtime carries, each with what it drives (the processor's values, never
# rebuilt): the prompt's attention_mask is all ones for one request and is the runtime's own.
PER_TOKEN = {
    "token_type_ids": "the spans attended both ways (models/masks.py)",
    "mm_token_type_ids": "which tokens take grid positions (runtime/positions.py)",
    "cross_attention_mask": "the tiles each token cross-attends (models/cross_attention.py)",
    image_mask.MASK: "where the image features go, for a family with no image token (models/image_mask.py)",
    vision_experts.TYPES: "which tokens go to the vision experts (models/vision_experts.py)",
}
_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(checkpoint: str | None, tokenizer):
    """The family's processor from the folder, or None: no processor in it, or one that cannot be
    built here (said at WARNING; chat images then take models/images.py's layout)."""
    if not checkpoint or tokenizer is None or not any((Path(checkpoint) / f).is_file() for f in _FILES):
        return None
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(checkpoint, local_files_only=True)
    except Exception as exc:  # a missing package (torchvision for a video half), a broken config
        _not_built(f"{type(exc).__name__}: {next((ln for ln in str(exc).splitlines() if ln.strip()), '')}")
        return None
    if not isinstance(processor, ProcessorMixin):  # AutoProcessor gave a tokenizer or image processor
        if (Path(checkpoint) / "processor_config.json").is_file():  # one was there, and is not used
            _not_built(f"AutoProcessor gives a {type(processor).__name__} for processor_config.json's class")
        return None
    if getattr(processor, "chat_template", None) is None and tokenizer.chat_template:
        processor.chat_template = tokenizer.chat_template
    return processor


# The output a processor returns for the loss alone: no logit depends on it
LOSS_TARGET = "labels"


def _not_built(why: str) -> None:
    log.warning(
        "the folder's processor cannot be built here (%s); chat images are laid out by the pipeline's "
        "rules for the family (models/images.py), not by the folder's processor",
        why.strip()[:240],
    )


def image_token_text(processor) -> str:
    """The text the processor expands into one image's tokens."""
    token = getattr(processor, "image_token", None) or getattr(processor.tokenizer, "image_token", None)
    token = getattr(token, "content", token)  # BLIP-2's processor keeps the AddedToken it made
    if not isinstance(token, str):
        raise ConfigError(
            f"{type(processor).__name__} names no image_token: the tokens of one image cannot be told apart "
            "from another's; give the folder a processor that does"
        )
    return token


def image_token_ids(processor, hf_config) -> set[int]:
    """The ids that stand for image features in the processor's output: the config's image token
    (or the processor's own, for a family whose config names none)."""
    found = {getattr(hf_config, n, None) for n in ("image_token_id", "image_token_index")}
    found = {i for i in found if isinstance(i, int)}
    if not found:
        found = {processor.tokenizer.convert_tokens_to_ids(image_token_text(processor))}
    return found


def forward_names(model: torch.nn.Module) -> dict[str, str]:
    """Each name the model's forward takes (or its inner model's: DeepSeek-VL's outer class passes
    **kwargs on to it) -> the parameter it reaches: itself, or the one a name transformers
    deprecated is renamed to (Fuyu's processor returns `image_patches`, its forward's
    `pixel_values`)."""
    names: dict[str, str] = {}
    inner = getattr(model, "model", None)
    for forward in (model.forward, inner.forward if isinstance(inner, torch.nn.Module) else None):
        if forward is not None:
            names |= _renamed(forward)
            names |= {name: name for name in inspect.signature(forward).parameters}
    return {k: v for k, v in names.items() if k not in ("kwargs", "args")}


def _renamed(function) -> dict[str, str]:
    """Deprecated keyword -> its new name, for each transformers `deprecate_kwarg` wrapped around
    the function (read from the wrappers' closures: they keep no other record)."""
    renamed = {}
    while function is not None:
        code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
        if code is not None and cells:
            bound = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True))
            if isinstance(bound.get("old_name"), str) and isinstance(bound.get("new_name"), str):
                renamed[bound["old_name"]] = bound["new_name"]
        function = getattr(function, "__wrapped__", None)
    return renamed


def _carried(key: str, hf_config, model) -> bool:
    """Whether the runtime gives the model this per-token output at every step, for this family."""
    if key == "token_type_ids":
        return masks.uses_blocks(hf_config)
    if key == "mm_token_type_ids":  # grid positions
        text = getattr(hf_config, "text_config", None) or hf_config
        return bool((getattr(text, "rope_parameters", None) or {}).get("mrope_section"))
    if key == vision_experts.TYPES:
        return vision_experts.routes(model)
    if key == image_mask.MASK:
        return image_mask.by_mask(hf_config)
    return key == "cross_attention_mask" and cross_attention.takes_vision_states(model)


class LayoutRefused(ConfigError):
    """The family's processor refuses the request's layout (Fuyu's: one image a prompt; PaliGemma's:
    a text without images)."""


def processed(processor, hf_config, text: str, images: list, skeleton, dtype, device):
    """One chat request as the family's processor makes it: (ids, pixel tensors, per-token tensors
    [S, ...], [start, end) of each image's tokens). Every tensor it returns that the model's
    forward names reaches the model, or the request is refused naming it. Each image's token count
    is the processor's (the image alone through it): no model runs to count them."""
    try:  # one text: its images in order
        out = processor(text=[text], images=images or None, return_tensors="pt")
    except ValueError as exc:  # a layout the family's processor refuses (Fuyu's: one image a prompt)
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
        raise LayoutRefused(
            f"{type(processor).__name__} cannot make this request of {len(images)} image(s): {first[:240]}"
        ) from None
    ids = out["input_ids"][0].tolist()
    names = forward_names(skeleton)
    per_token, pixels = {}, {}
    for key, value in out.items():
        if not isinstance(value, torch.Tensor) or key in ("input_ids", "attention_mask") or key not in names:
            continue
        key = names[key]
        if key == LOSS_TARGET:
            log.info(
                "%s returns %s: targets of the training loss, not read by generation",
                type(processor).__name__,
                key,
            )
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == (1, len(ids)):  # [1, S, ...] beside the ids
            if not _carried(key, hf_config, skeleton):
                raise ConfigError(
                    f"{type(processor).__name__} returns {key} {list(value.shape)}, a value per token that "
                    f"{type(skeleton).__name__}.forward reads and the runtime does not give the captured "
                    f"language model (it takes ids, positions and its cache): model_type={hf_config.model_type} "
                    "cannot run here"
                )
            per_token[key] = value[0]
        else:
            pixels[key] = value
    pixels = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in pixels.items()}
    if not images:
        return ids, pixels, per_token, []
    if image_mask.MASK in per_token:  # image places by the processor's mask, not by an id
        tokens, marker = set(), ""
        where = per_token[image_mask.MASK].nonzero().flatten().tolist()
    else:
        tokens = image_token_ids(processor, hf_config)
        # a text without the image token: the processor places the image itself (Fuyu's, before the text)
        marker = image_token_text(processor)
        marker = marker if marker in text else ""
        where = [i for i, t in enumerate(ids) if t in tokens]
    counts = [_image_count(processor, image, tokens, marker) for image in images]
    if len(where) != sum(counts):
        raise ConfigError(
            f"{type(processor).__name__} wrote {len(where)} image tokens for {len(images)} image(s), and "
            f"{sum(counts)} for the same images one at a time; check the folder's processor_config.json"
        )
    spans, start = [], 0
    for n in counts:  # each image's tokens in order, whatever the processor writes between them
        spans.append((where[start], where[start + n - 1] + 1))
        start += n
    return ids, pixels, per_token, spans


def _image_count(processor, image, tokens: set[int], marker: str) -> int:
    """How many image tokens the processor writes for this image alone (`marker`: the text it takes;
    the places its mask marks, for a family without an image token)."""
    out = processor(text=[marker], images=[image], return_tensors="pt")
    if image_mask.MASK in out:
        return int(out[image_mask.MASK].sum())
    return sum(int(t) in tokens for t in out["input_ids"][0].tolist())


def check_image_counts(model: torch.nn.Module, processor, hf_config, request) -> None:
    """Each image's tokens the processor wrote in a request against the features the model makes
    of it (its vision path on its own weights, once): a processor config that disagrees with the
    model's is refused before export, naming the file, where Hugging Face's forward would fail
    mid-generation."""
    if cross_attention.takes_vision_states(model) or imaging.featurer(model) is None:
        return  # one token per image, cross-attended; or images that become no prompt tokens
    if image_mask.MASK in request.token_inputs:  # each span is the places its mask marks
        wrote = [e - s for s, e in request.image_spans]
    else:
        tokens = image_token_ids(processor, hf_config)
        wrote = [sum(t in tokens for t in request.prompt[s:e]) for s, e in request.image_spans]
    made = imaging.image_tokens(model, request.images, len(wrote))
    if wrote != made:
        raise StageFailure(
            f"{type(processor).__name__} wrote {wrote} image tokens for the image(s) of request "
            f"{request.seq_id}, and the model makes {made} of them; check the processor's settings (a folder's "
            "processor_config.json; models/families.py for one built from the config) against config.json"
        )

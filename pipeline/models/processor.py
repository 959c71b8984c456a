"""The family's own processor, where a checkpoint folder lets it be built offline: what lays a chat
request's image tokens out exactly as Hugging Face's processor does (Idefics3's tiles with their
row and column tokens, GOT-OCR2's `<img>` ... `</img>`, Gemma 3's blank lines around an image).

Built from the folder's `processor_config.json` around the folder's tokenizer and image processor,
as `AutoProcessor.from_pretrained` would; a processor that cannot be built here (a video half that
needs torchvision, which does not install beside the CPU torch: Qwen2-VL's, GLM-4V's, InternVL's)
leaves the request to models/images.py's layout, which the model's own token count drives.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.errors import ConfigError
from pipeline.models import cross_attention
from pipeline.models import images as imaging

log = logging.getLogger(__name__)

# What a processor returns beside the pixels that the runtime makes itself: the ids, and the masks
# and token types it derives from them (models/masks.py, runtime/positions.py)
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "cross_attention_mask")


def load_processor(checkpoint: str | None, model_type: str, tokenizer, image_processor):
    """The family's processor from the folder, or None (no processor config, no tokenizer, or a
    processor that cannot be built here: said in the log)."""
    if not checkpoint or tokenizer is None or not (Path(checkpoint) / "processor_config.json").is_file():
        return None
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    processor_cls = getattr(transformers, name, None) if name else None
    if processor_cls is None:
        return None
    parts = {"tokenizer": tokenizer}
    if image_processor is not None:
        parts["image_processor"] = image_processor
    try:
        return processor_cls.from_pretrained(checkpoint, local_files_only=True, **parts)
    except (ImportError, AttributeError, OSError, TypeError, ValueError) as exc:
        log.info(
            "%s cannot be built here (%s: %s); chat images are laid out from the model's token count",
            name,
            type(exc).__name__,
            str(exc).splitlines()[0][:200],
        )
        return None


def processed(processor, hf_config, text: str, images: list, skeleton, dtype, device):
    """(ids, pixel tensors the model's forward takes, [start, end) of each image's tokens) of one
    chat request as the family's processor makes it. The image tokens it wrote must be as many as
    the model makes of the images (counted on the meta-device skeleton), else the processor config
    and the model disagree."""
    out = processor(text=[text], images=images, return_tensors="pt")  # one text: its images in order
    ids = out["input_ids"][0].tolist()
    tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k not in _TEXT_KEYS}
    pixels = imaging.taken(skeleton.forward, tensors)
    if cross_attention.takes_vision_states(skeleton):  # one token per image, cross-attended
        counts = [1] * len(images)
    else:
        counts = imaging.image_tokens(skeleton, pixels, len(images))
    token = imaging.image_token_id(hf_config)
    where = [i for i, t in enumerate(ids) if t == token]
    if len(where) != sum(counts):
        raise ConfigError(
            f"the checkpoint's processor wrote {len(where)} image tokens for {len(images)} image(s), and the "
            f"model makes {sum(counts)} of them; check processor_config.json against config.json"
        )
    spans, start = [], 0
    for n in counts:  # each image's tokens in order, whatever the processor writes between them
        spans.append((where[start], where[start + n - 1] + 1))
        start += n
    pixels = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in pixels.items()}
    return ids, pixels, spans

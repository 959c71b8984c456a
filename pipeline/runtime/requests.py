"""Requests for demollm: prompts as token ids, and for VLMs their images in the model's layout.

Sources: random token ids of `prompt.prompt_len` (the profiling workload, the default), explicit
token id lists in `prompt.queries`, or text queries tokenized with a tokenizer from a local
checkpoint folder. VLM requests carry one image each, through the family's preprocessing, with
its image placeholder tokens inserted: seeded synthetic images of `prompt.image_size` by default,
or local files from `prompt.images` (cycled over the requests). Nothing is fetched: a URL is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from pipeline.config import PipelineConfig, PromptConfig, RuntimeConfig
from pipeline.errors import ConfigError
from pipeline.models.images import default_image_size, image_token_id, load_image, preprocess, synthetic_image
from pipeline.models.inputs import random_ids, special_ids


@dataclass
class Request:
    seq_id: int
    prompt: list[int]  # token ids, image placeholders included
    images: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # this request's pixel tensors (dim 0 concatenates)


def image_part(hf_config, image: Image.Image, dtype, device) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One image as a request carries it: its placeholder tokens and its pixel tensors."""
    batch = preprocess(hf_config, [image], dtype, device)
    return batch.placeholder(image_token_id(hf_config), 0), batch.kwargs


def _text_of(query: Any) -> str | None:
    if isinstance(query, str):
        return query
    if isinstance(query, dict) and "prompt" in query:
        return str(query["prompt"])
    return None


def _refuse_urls(query: Any, index: int) -> None:
    text = str(query)
    if "http://" in text or "https://" in text:
        raise ConfigError(
            f"prompt.queries[{index}] names a URL; nothing can be fetched offline: use a local file path"
        )


def check_queries(queries, has_tokenizer: bool) -> None:
    """Before any model is built: queries that need a tokenizer need a local one."""
    for index, query in enumerate(queries or []):
        _refuse_urls(query, index)
        if query in ("", [], {}) or (isinstance(query, dict) and not query.get("prompt", "x")):
            raise ConfigError(f"prompt.queries[{index}] is empty; give it text, token ids or messages")
        is_ids = isinstance(query, list | tuple) and all(isinstance(t, int) for t in query)
        if not is_ids and not has_tokenizer:
            raise ConfigError(
                f"prompt.queries[{index}] is text, and no tokenizer is available offline: give token id lists, "
                "or set model.checkpoint to a local folder with a tokenizer"
            )


def check_images(paths, hf_config) -> None:
    """Before any model is built: each local image opens, and holds at least one patch of the
    model's vision tower (its preprocessing converts mode and size, but not from nothing)."""
    vision = getattr(hf_config, "vision_config", None)
    for index, path in enumerate(paths or []):
        try:
            with Image.open(path) as image:
                width, height = image.size
        except OSError as exc:
            raise ConfigError(f"prompt.images[{index}]={path} cannot be read as an image: {exc}") from None
        patch = getattr(vision, "patch_size", 1) if vision is not None else 1
        if min(width, height) < patch:
            raise ConfigError(
                f"prompt.images[{index}]={path} is {width}x{height} pixels, smaller than one {patch}-pixel patch "
                "of this model's vision tower; use a larger image"
            )


def check_workload(cfg: PipelineConfig, hf_config) -> None:
    """Before any model is built: the generated workload's requests can be made (room for text
    beside each distinct image, input and sequence limits). Each distinct image is preprocessed
    once, on CPU; no model is needed."""
    if cfg.prompt.queries:
        return  # checked by check_queries; tokenizing needs the checkpoint's tokenizer
    probe = dataclasses.replace(
        cfg.prompt, batch_size=max(1, min(cfg.prompt.batch_size, len(cfg.prompt.images or [None])))
    )
    build_requests(probe, cfg.runtime, cfg.seed, hf_config, torch.float32, torch.device("cpu"))


def build_requests(
    prompt: PromptConfig, runtime: RuntimeConfig, seed: int, hf_config, dtype, device, tokenizer=None
) -> list[Request]:
    text_config = getattr(hf_config, "text_config", None) or hf_config
    generator = torch.Generator().manual_seed(seed)
    is_vlm = getattr(hf_config, "vision_config", None) is not None
    queries = prompt.queries or None
    requests = []
    for seq_id in range(prompt.batch_size if queries is None else len(queries)):
        images: dict[str, torch.Tensor] = {}
        image_tokens: list[int] = []
        if is_vlm and queries is None:
            if prompt.images:
                image = load_image(prompt.images[seq_id % len(prompt.images)])
            else:
                image = synthetic_image(prompt.image_size or default_image_size(hf_config), generator)
            image_tokens, images = image_part(hf_config, image, dtype, device)
        if queries is None:
            text_len = prompt.prompt_len - len(image_tokens)
            if text_len < 1:
                raise ConfigError(
                    f"prompt.prompt_len={prompt.prompt_len} leaves no room for text beside the image's "
                    f"{len(image_tokens)} tokens; set prompt.prompt_len>={len(image_tokens) + 1} or a smaller "
                    "prompt.image_size"
                )
            ids = random_ids((text_len,), text_config.vocab_size, special_ids(hf_config), generator).tolist()
            half = len(ids) // 2
            tokens = ids[:half] + image_tokens + ids[half:]
        else:
            query = queries[seq_id]
            if isinstance(query, list | tuple) and all(isinstance(t, int) for t in query):
                tokens = list(query)
            else:
                text = _text_of(query)
                if text is None:
                    raise ConfigError(
                        f"prompt.queries[{seq_id}]: chat messages need a chat template and processor"
                    )
                tokens = tokenizer(text)["input_ids"]
        if not tokens:
            raise ConfigError(f"request {seq_id} has an empty prompt")
        if len(tokens) > runtime.max_input_len:
            raise ConfigError(
                f"request {seq_id} has {len(tokens)} prompt tokens > runtime.max_input_len={runtime.max_input_len}"
            )
        if len(tokens) + prompt.output_len > runtime.max_seq_len:
            raise ConfigError(
                f"request {seq_id}: {len(tokens)} prompt + {prompt.output_len} output tokens > runtime.max_seq_len="
                f"{runtime.max_seq_len}; shorten it or raise runtime.max_seq_len"
            )
        requests.append(Request(seq_id, tokens, images))
    return requests

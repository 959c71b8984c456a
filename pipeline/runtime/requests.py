"""Requests for demollm: prompts as token ids, and for VLMs their images in the model's layout.

Sources: random token ids of `prompt.prompt_len` (the profiling workload, the default; VLM requests
carry one image each, seeded synthetic noise of `prompt.image_size`, or local files from
`prompt.images`, cycled), or `prompt.queries` (runtime/queries.py): token id lists as they are,
text through the checkpoint's tokenizer, chat messages through its chat template with each image
part through the family's processing (models/images.py). With queries there are
max(prompt.batch_size, len(queries)) requests, the queries cycled. Every request knows where each of
its images' tokens lie (`image_span`), so a chunked prefill never splits them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from PIL import Image

from pipeline.config import PipelineConfig, PromptConfig, RuntimeConfig
from pipeline.errors import ConfigError
from pipeline.models import images as imaging
from pipeline.models.inputs import random_ids, special_ids
from pipeline.runtime import queries as query_forms


@dataclass
class Request:
    seq_id: int
    prompt: list[int]  # token ids, image tokens included
    images: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel tensors (dim 0 concatenates)
    # [start, end): from the first image's first token to the last image's last; a prefill chunk
    # never splits it (the vision tower's features of a request go into one step)
    image_span: tuple[int, int] | None = None

    @property
    def images_at(self) -> tuple[int, int] | None:
        """The tokens a prefill chunk must hold whole, with the images: image_span, or the whole
        prompt for a request built with images and no span."""
        if not self.images:
            return None
        return self.image_span or (0, len(self.prompt))


@dataclass
class Sources:
    """What turns queries into token ids and pixels: from the checkpoint folder when there is one."""

    tokenizer: object | None = None
    image_processor: object | None = None


def image_part(hf_config, image: Image.Image, dtype, device, processor=None) -> tuple[list[int], dict]:
    """One image as a synthetic request carries it: its placeholder tokens and its pixel tensors."""
    batch = imaging.preprocess(hf_config, [image], dtype, device, processor)
    return batch.placeholder(imaging.image_token_id(hf_config), 0), batch.kwargs


def _synthetic(prompt: PromptConfig, seq_id: int, hf_config, generator, dtype, device, sources) -> Request:
    image_tokens: list[int] = []
    pixels: dict[str, torch.Tensor] = {}
    if getattr(hf_config, "vision_config", None) is not None:
        if prompt.images:
            image = imaging.load_image(prompt.images[seq_id % len(prompt.images)])
        else:
            image = imaging.synthetic_image(
                prompt.image_size or imaging.default_image_size(hf_config), generator
            )
        image_tokens, pixels = image_part(hf_config, image, dtype, device, sources.image_processor)
    text_len = prompt.prompt_len - len(image_tokens)
    if text_len < 1:
        raise ConfigError(
            f"prompt.prompt_len={prompt.prompt_len} leaves no room for text beside the image's "
            f"{len(image_tokens)} tokens; set prompt.prompt_len>={len(image_tokens) + 1} or a smaller "
            "prompt.image_size"
        )
    text_config = getattr(hf_config, "text_config", None) or hf_config
    ids = random_ids((text_len,), text_config.vocab_size, special_ids(hf_config), generator).tolist()
    half = len(ids) // 2
    span = (half, half + len(image_tokens)) if image_tokens else None
    return Request(seq_id, ids[:half] + image_tokens + ids[half:], pixels, span)


def _chat(query: query_forms.Query, seq_id: int, hf_config, dtype, device, sources: Sources) -> Request:
    """The chat template's text, tokenized; each image token of the template expanded as the family's
    processor does, the images preprocessed together."""
    tokenizer = sources.tokenizer
    text = tokenizer.apply_chat_template(query.messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not query.images:
        return Request(seq_id, ids)
    placeholder = imaging.chat_placeholder(hf_config, tokenizer)
    where = [i for i, token in enumerate(ids) if token == placeholder]
    if len(where) != len(query.images):
        raise ConfigError(
            f"the chat template wrote {len(where)} image tokens for {len(query.images)} image parts; "
            "check the checkpoint's chat template"
        )
    batch = imaging.preprocess(
        hf_config, [imaging.load_image(str(p)) for p in query.images], dtype, device, sources.image_processor
    )
    prompt: list[int] = []
    first = last = 0
    for index, position in enumerate(where):
        prompt += ids[last:position]
        first = first if index else len(prompt)
        prompt += imaging.expand(hf_config, tokenizer, batch, index)
        last = position + 1
    return Request(seq_id, prompt + ids[last:], batch.kwargs, (first, len(prompt)))


def _from_query(query: query_forms.Query, seq_id: int, hf_config, dtype, device, sources: Sources) -> Request:
    if query.kind == "ids":
        return Request(seq_id, list(query.ids))
    if query.kind == "text":
        return Request(seq_id, sources.tokenizer(query.text)["input_ids"])
    return _chat(query, seq_id, hf_config, dtype, device, sources)


def _check_lengths(request: Request, prompt: PromptConfig, runtime: RuntimeConfig, chunked: bool) -> None:
    n = len(request.prompt)
    if not n:
        raise ConfigError(f"request {request.seq_id} has an empty prompt")
    if n > runtime.max_input_len:
        raise ConfigError(
            f"request {request.seq_id} has {n} prompt tokens > runtime.max_input_len={runtime.max_input_len}"
        )
    if n + prompt.output_len > runtime.max_seq_len:
        raise ConfigError(
            f"request {request.seq_id}: {n} prompt + {prompt.output_len} output tokens > runtime.max_seq_len="
            f"{runtime.max_seq_len}; shorten it or raise runtime.max_seq_len"
        )
    if not chunked and n > runtime.max_num_tokens:
        raise ConfigError(
            f"request {request.seq_id} has {n} prompt tokens > runtime.max_num_tokens={runtime.max_num_tokens}, "
            "and capture=none prefills a prompt whole (Hugging Face's cache); raise runtime.max_num_tokens"
        )
    if (
        request.image_span
        and (size := request.image_span[1] - request.image_span[0]) > runtime.max_num_tokens
    ):
        raise ConfigError(
            f"request {request.seq_id} has {size} image tokens > runtime.max_num_tokens={runtime.max_num_tokens}, "
            "and a prefill chunk never splits a request's images; raise runtime.max_num_tokens"
        )


def build_requests(
    prompt: PromptConfig,
    runtime: RuntimeConfig,
    seed: int,
    hf_config,
    dtype,
    device,
    sources: Sources | None = None,
    chunked: bool = True,
) -> list[Request]:
    """chunked: whether prefill may split a prompt over steps (the paged runner; not capture=none)."""
    sources = sources or Sources()
    generator = torch.Generator().manual_seed(seed)
    parsed = query_forms.parse(prompt.queries)
    count = max(prompt.batch_size, len(parsed)) if parsed else prompt.batch_size
    requests = []
    for seq_id in range(count):
        if parsed:
            request = _from_query(parsed[seq_id % len(parsed)], seq_id, hf_config, dtype, device, sources)
        else:
            request = _synthetic(prompt, seq_id, hf_config, generator, dtype, device, sources)
        _check_lengths(request, prompt, runtime, chunked)
        requests.append(request)
    return requests


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


def check_workload(cfg: PipelineConfig, hf_config, sources: Sources) -> None:
    """Before any model is built: every query's request can be made (tokenized, images processed),
    and so can the generated workload's (room for text beside each distinct image); input, sequence
    and token-budget limits hold. All on CPU; no model is needed."""
    prompt = cfg.prompt
    if not prompt.queries:  # each distinct image once: the synthetic requests differ only in them
        prompt = dataclasses.replace(
            prompt, batch_size=max(1, min(prompt.batch_size, len(prompt.images or [None])))
        )
    else:
        prompt = dataclasses.replace(prompt, batch_size=1)  # each query once
    chunked = cfg.capture.mode != "none"
    build_requests(
        prompt, cfg.runtime, cfg.seed, hf_config, torch.float32, torch.device("cpu"), sources, chunked
    )

"""Requests for demollm: prompts as token ids, and for VLMs their images in the model's layout.

Sources: random token ids of `prompt.prompt_len` (the profiling workload, the default; VLM requests
carry one image each, seeded synthetic noise of `prompt.image_size`, or local files from
`prompt.images`, cycled), or `prompt.queries` (runtime/queries.py): token id lists as they are,
text through the checkpoint's tokenizer, chat messages through its chat template with each image
part through the family's processing (models/images.py). With queries there are
max(prompt.batch_size, len(queries)) requests, the queries cycled. Every request knows where each of
its images' tokens lie (`image_spans`) and which spans the model attends both ways, so a chunked
prefill never splits them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from PIL import Image

from pipeline.config import PipelineConfig, PromptConfig, RuntimeConfig
from pipeline.errors import ConfigError
from pipeline.models import families, image_mask, masks, zoo
from pipeline.models import images as imaging
from pipeline.models.inputs import cross_attention_rows, random_ids, special_ids
from pipeline.models.processor import LayoutRefused, load_processor, processed
from pipeline.models.tokenizer import load_tokenizer
from pipeline.runtime import queries as query_forms


@dataclass
class Request:
    seq_id: int
    prompt: list[int]  # token ids, image tokens included
    images: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel tensors (dim 0 concatenates)
    image_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each image's tokens
    # [start, end) spans the model attends both ways (models/masks.py): PaliGemma's prompt, Gemma 3's images
    bidirectional: list[tuple[int, int]] = field(default_factory=list)
    # [P, images, tiles]: the tiles each prompt token attends, for a family whose language model
    # cross-attends the vision states (models/cross_attention.py); None otherwise
    cross_attention_mask: torch.Tensor | None = None
    # what the family's processor returned per prompt token ([P, ...] each; models/processor.py
    # PER_TOKEN): read in place of what the runtime would derive from the ids
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def unsplit_span(self) -> tuple[int, int] | None:
        """The tokens one prefill chunk must hold whole: the images (the vision tower's features of a
        request go into one step; the whole prompt for a request built with images and no spans)
        and every span attended both ways."""
        spans = [*self.image_spans, *self.bidirectional]
        if self.images and not self.image_spans:
            spans.append((0, len(self.prompt)))
        if not spans:
            return None
        return min(s for s, _ in spans), max(e for _, e in spans)


@dataclass
class Sources:
    """What turns queries into token ids and pixels: from the checkpoint folder when there is one,
    and the model's meta-device skeleton, which counts a fixed-size family's image tokens."""

    tokenizer: object | None = None
    image_processor: object | None = None
    skeleton: torch.nn.Module | None = None
    processor: object | None = None  # the folder's processor (models/processor.py), where it builds
    # What makes the generated workload's image requests: the folder's Processor, else the family's
    # built from the config (models/families.py); None: the generic layout. `layout` says which, in
    # one line, and why where it is the generic one.
    layout_processor: object | None = None
    layout: str = ""


def sources_of(
    checkpoint: str | None, hf_config, skeleton: torch.nn.Module, image_layout: str = "family"
) -> Sources:
    """The sources a checkpoint folder gives (none without one), the skeleton, and for a VLM the
    Processor that lays out its synthetic image requests (prompt.image_layout)."""
    tokenizer = load_tokenizer(checkpoint)
    image_processor = imaging.checkpoint_image_processor(checkpoint)
    processor = load_processor(checkpoint, tokenizer)
    sources = Sources(tokenizer, image_processor, skeleton, processor)
    if zoo.is_vlm(hf_config):
        sources.layout_processor, sources.layout = _synthetic_layout(image_layout, hf_config, sources)
    return sources


def _synthetic_layout(image_layout: str, hf_config, sources: Sources) -> tuple[object | None, str]:
    """(the Processor that makes synthetic image requests or None, the line that says which)."""
    generic = (
        "synthetic image requests take the generic layout (prompt.image_layout=generic, models/images.py)"
    )
    # the generic layout writes an image token, which such a family has not
    if image_mask.by_mask(hf_config) and (
        image_layout == "generic" or (sources.processor is None and sources.tokenizer is not None)
    ):
        raise ConfigError(
            f"model_type={hf_config.model_type} marks image positions by a mask its processor returns, which "
            "the generic layout cannot make: set prompt.image_layout=family (a model.checkpoint folder "
            "with a tokenizer needs its processor_config.json too)"
        )
    if image_layout == "generic":
        return None, generic
    if sources.processor is not None:
        processor, made_by = sources.processor, "the folder's"
    elif sources.tokenizer is not None:
        return None, f"{generic}: the folder has a tokenizer and no Processor"
    elif hf_config.model_type not in families.PROCESSOR_KWARGS:
        return None, f"{generic}: no {hf_config.model_type} Processor is built here (models/families.py)"
    else:
        try:
            processor = families.family_processor(hf_config, image_processor=sources.image_processor)
        except Exception as exc:  # a missing package, a setting this config cannot take
            first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
            return (
                None,
                f"{generic}: the {hf_config.model_type} Processor cannot be built ({type(exc).__name__}: {first[:160]})",
            )
        made_by = "the family's, built from the config"
    if not getattr(processor, "chat_template", None):
        return None, f"{generic}: {type(processor).__name__} has no chat template"
    return processor, (
        f"synthetic image requests: a chat turn made by {type(processor).__name__} ({made_by}) and its "
        "chat template (prompt.image_layout=family)"
    )


def with_mask_spans(hf_config, request: Request) -> Request:
    """The request with what its model's masks read filled in: the spans it attends both ways
    (models/masks.py), the tiles each token cross-attends (models/cross_attention.py); from the
    processor's per-token outputs where the request has them, else from the ids."""
    types = request.token_inputs.get("token_type_ids")
    if types is not None:
        request.bidirectional = masks.spans_from_token_types(hf_config, types.tolist())
    else:
        request.bidirectional = masks.bidirectional_spans(hf_config, request.prompt)
    if "cross_attention_mask" in request.token_inputs:
        request.cross_attention_mask = request.token_inputs["cross_attention_mask"]
    elif request.images and zoo.takes_vision_states(hf_config):
        request.cross_attention_mask = cross_attention_rows(hf_config, request.prompt, request.images)
    return request


def image_part(
    hf_config, image: Image.Image, dtype, device, processor=None, skeleton=None
) -> tuple[list[int], dict]:
    """One image as a synthetic request carries it: its placeholder tokens and its pixel tensors."""
    batch = imaging.preprocess(hf_config, [image], dtype, device, processor, skeleton)
    return batch.placeholder(imaging.image_token_id(hf_config), 0), batch.kwargs


FILL_PASSES = 16  # after the bisection, a byte-level BPE's prompt lands on prompt_len within a few


def _family_request(
    prompt: PromptConfig, seq_id: int, hf_config, image: Image.Image, generator, dtype, device, sources
) -> Request:
    """A synthetic image request as the family makes one: a user turn holding the image and random
    text, through its chat template and Processor. The text is random ids decoded, as many as fill
    prompt.prompt_len; where the turn's tokens do not add up (text that merges with the template's,
    a folder's subword tokenizer), the text is the fewest ids of a longer draw whose prompt reaches
    prompt_len, then passes add or drop the difference (at most FILL_PASSES): the prompt is as long
    as the Processor makes it after the last."""
    processor = sources.layout_processor
    tokenizer = processor.tokenizer

    def made(text_ids: list[int]):
        content = [{"type": "image"}, {"type": "text", "text": tokenizer.decode(text_ids)}]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            chat_template=processor.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return processed(processor, hf_config, text, [image], sources.skeleton, dtype, device)

    frame = len(made([])[0])  # the turn's markers and the image's tokens
    text_len = prompt.prompt_len - frame
    if text_len < 1:
        raise ConfigError(
            f"prompt.prompt_len={prompt.prompt_len} leaves no room for text beside the chat turn and image's "
            f"{frame} tokens; set prompt.prompt_len>={frame + 1} or a smaller prompt.image_size"
        )
    vocab = min(len(tokenizer), zoo.text_config_of(hf_config).vocab_size)
    avoid = special_ids(hf_config) | set(tokenizer.all_special_ids)
    text = random_ids((text_len,), vocab, avoid, generator).tolist()
    made_ids = made(text)
    if len(made_ids[0]) != prompt.prompt_len:
        # text merged with the template's, or re-cut by a subword tokenizer (random ids of a
        # byte-level BPE decode to text that re-encodes into fewer pieces): bisect a longer draw
        # for the fewest ids whose prompt reaches prompt_len, then add or drop the difference
        pool = text + random_ids((prompt.prompt_len,), vocab, avoid, generator).tolist()
        low, high = 1, len(pool)
        while low < high:
            middle = (low + high) // 2
            if len(made(pool[:middle])[0]) < prompt.prompt_len:
                low = middle + 1
            else:
                high = middle
        text = pool[:low]
        made_ids = made(text)
        for _ in range(FILL_PASSES):
            short = prompt.prompt_len - len(made_ids[0])
            if not short or len(text) + short < 1:
                break
            text = (text + random_ids((max(short, 0),), vocab, avoid, generator).tolist())[
                : len(text) + short
            ]
            made_ids = made(text)
    ids, pixels, per_token, spans = made_ids
    return with_mask_spans(hf_config, Request(seq_id, ids, pixels, spans, token_inputs=per_token))


def _synthetic(prompt: PromptConfig, seq_id: int, hf_config, generator, dtype, device, sources) -> Request:
    image_tokens: list[int] = []
    pixels: dict[str, torch.Tensor] = {}
    # A VLM's request carries an image, a given one or synthetic; where the family's images cannot
    # be prepared, preprocessing refuses the workload up front (check_workload) saying why, rather
    # than running it as text
    if zoo.is_vlm(hf_config):
        if prompt.images:
            image = imaging.load_image(prompt.images[seq_id % len(prompt.images)])
        else:
            image = imaging.synthetic_image(
                prompt.image_size or imaging.default_image_size(hf_config), generator
            )
        if sources.layout_processor is not None:
            return _family_request(prompt, seq_id, hf_config, image, generator, dtype, device, sources)
        image_tokens, pixels = image_part(
            hf_config, image, dtype, device, sources.image_processor, sources.skeleton
        )
    text_len = prompt.prompt_len - len(image_tokens)
    if text_len < 1:
        raise ConfigError(
            f"prompt.prompt_len={prompt.prompt_len} leaves no room for text beside the image's "
            f"{len(image_tokens)} tokens; set prompt.prompt_len>={len(image_tokens) + 1} or a smaller "
            "prompt.image_size"
        )
    text_config = getattr(hf_config, "text_config", None) or hf_config
    ids = random_ids((text_len,), text_config.vocab_size, special_ids(hf_config), generator).tolist()
    # images in the middle of the text, or first for a family whose processor puts them there
    half = 0 if hf_config.model_type in imaging.IMAGES_FIRST else len(ids) // 2
    spans = [(half, half + len(image_tokens))] if image_tokens else []
    request = Request(seq_id, ids[:half] + image_tokens + ids[half:], pixels, spans)
    return with_mask_spans(hf_config, request)


def _chat(query: query_forms.Query, seq_id: int, hf_config, dtype, device, sources: Sources) -> Request:
    """The chat template's text, tokenized; each image token of the template expanded as the family's
    processor does, the images preprocessed together."""
    tokenizer = sources.tokenizer
    text = tokenizer.apply_chat_template(query.messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    images = [imaging.load_image(str(p)) for p in query.images]
    if sources.processor is not None:
        # a text alone too: the processor adds what it adds to any text (Kosmos-2's begin token)
        try:
            prompt, pixels, per_token, spans = processed(
                sources.processor, hf_config, text, images, sources.skeleton, dtype, device
            )
            return with_mask_spans(hf_config, Request(seq_id, prompt, pixels, spans, token_inputs=per_token))
        except LayoutRefused:
            if images:
                raise
            # a processor that refuses a text alone (PaliGemma's): the template's text, tokenized
    if not images:
        return with_mask_spans(hf_config, Request(seq_id, ids))
    if image_mask.by_mask(hf_config):
        raise ConfigError(
            f"model_type={hf_config.model_type} marks image positions by a mask its processor returns, and "
            "model.checkpoint has no processor that builds here; give a folder with its processor_config.json"
        )
    placeholder = imaging.chat_placeholder(hf_config, tokenizer)
    where = [i for i, token in enumerate(ids) if token == placeholder]
    if len(where) != len(query.images):
        raise ConfigError(
            f"the chat template wrote {len(where)} image tokens for {len(query.images)} image parts; "
            "check the checkpoint's chat template"
        )
    batch = imaging.preprocess(hf_config, images, dtype, device, sources.image_processor, sources.skeleton)
    if zoo.takes_vision_states(hf_config):  # [images, 1, ...] -> one sequence's [1, images, ...]
        batch.kwargs = {k: v.transpose(0, 1) for k, v in batch.kwargs.items()}
    prompt: list[int] = []
    spans: list[tuple[int, int]] = []
    last = 0
    for index, position in enumerate(where):
        prompt += ids[last:position]
        tokens = imaging.expand(hf_config, tokenizer, batch, index)
        spans.append((len(prompt), len(prompt) + len(tokens)))
        prompt += tokens
        last = position + 1
    return with_mask_spans(hf_config, Request(seq_id, prompt + ids[last:], batch.kwargs, spans))


def _from_query(query: query_forms.Query, seq_id: int, hf_config, dtype, device, sources: Sources) -> Request:
    if query.kind == "ids":
        return with_mask_spans(hf_config, Request(seq_id, list(query.ids)))
    if query.kind == "text":
        return with_mask_spans(hf_config, Request(seq_id, sources.tokenizer(query.text)["input_ids"]))
    return _chat(query, seq_id, hf_config, dtype, device, sources)


def _check_lengths(
    request: Request, prompt: PromptConfig, runtime: RuntimeConfig, chunked: bool, hf_config
) -> None:
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
    if why := masks.span_past_window(hf_config, request.bidirectional):
        raise ConfigError(f"request {request.seq_id}: {why}; shorten its prompt")
    if (span := request.unsplit_span) and span[1] - span[0] > runtime.max_num_tokens:
        raise ConfigError(
            f"request {request.seq_id} has {span[1] - span[0]} tokens one prefill step must hold whole (its "
            f"images, and what the model attends both ways) > runtime.max_num_tokens={runtime.max_num_tokens}; "
            "raise runtime.max_num_tokens"
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
        _check_lengths(request, prompt, runtime, chunked, hf_config)
        requests.append(request)
    return requests


def check_images(paths, hf_config) -> None:
    """Before any model is built: each local image opens, and holds at least one patch of the
    model's vision tower, or of its own patch embedding (its preprocessing converts mode and size,
    but not from nothing; Fuyu's cuts the image as it is)."""
    patch = imaging.patch_of(hf_config) or 1
    for index, path in enumerate(paths or []):
        try:
            with Image.open(path) as image:
                width, height = image.size
        except OSError as exc:
            raise ConfigError(f"prompt.images[{index}]={path} cannot be read as an image: {exc}") from None
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

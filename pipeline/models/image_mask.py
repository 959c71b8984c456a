"""Families whose processor marks image positions by a mask, not by an image token id. Kosmos-2's
processor writes an image's places as ordinary ids (those after its unknown token's) between
`<image>` and `</image>`, and returns `image_embeds_position_mask` [1, S], 1 at each place; its
language model (the decoder stack export captures) writes the image features there itself.

What the pipeline does for such a family:
- the mask is one of the processor's per-token outputs (models/processor.py): a request carries it
  (`Request.token_inputs`), each image's span is read from it, and each prefill step that holds
  images passes its slice of it (runtime/executors.py `PREFILL_TOKEN_INPUTS`);
- `prepare` makes the model's calls fit one graph: the forward refuses a call with neither pixels
  nor image features (a decode step, a text request, export's text call), so such a call gets an
  empty set of features, which reaches the language model as no image input at all; and the
  features of a call's images reach it as one row [1, images * places, H], so the graph's image
  input has one dynamic dim, the image places of the call (0 in a call without images).
"""

from __future__ import annotations

import inspect

from torch import nn

MASK = "image_embeds_position_mask"
FEATURES = "image_embeds"
FAMILIES = ("kosmos-2",)  # model types whose config names no image token: positions by MASK


def by_mask(config) -> bool:
    """Whether the family's image positions come from its processor's mask."""
    return config.model_type in FAMILIES


def _takes(module: nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return MASK in parameters and FEATURES in parameters


def prepare(model: nn.Module, language_model: str) -> nn.Module:
    """The model with its calls made one graph's (see the module docstring); a no-op for other
    families. language_model: the path of the decoder stack export captures."""
    parent_path = language_model.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if language_model else None
    if parent is None or parent is model or not _takes(model) or not _takes(parent):
        return model
    embedding = model.get_input_embeddings()

    def no_images(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args or kwargs.get("pixel_values") is not None or kwargs.get(FEATURES) is not None:
            return args, kwargs
        weight = embedding.weight  # read at the call: the model may have moved or changed dtype
        return args, {**kwargs, FEATURES: weight.new_zeros(0, weight.shape[1])}  # [0 places, H]

    def one_row(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        features = kwargs.get(FEATURES)
        if args or features is None:
            return args, kwargs
        if features.numel() == 0:  # no image in the call: no image input, as a text call has
            return args, {**kwargs, FEATURES: None, MASK: None}
        # [images, places, H] -> [1, images * places, H]: the language model writes them in order
        return args, {**kwargs, FEATURES: features.reshape(1, -1, features.shape[-1])}

    model.register_forward_pre_hook(no_images, with_kwargs=True)
    parent.register_forward_pre_hook(one_row, with_kwargs=True)
    return model

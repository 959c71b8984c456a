"""Families whose forward merges image features into every call: BLIP-2's takes `pixel_values`
without a default and runs its vision tower and Q-Former each time, so a call without images
(a text request, a decode step, export's text call, each check) cannot be made of it as of other
families. Such a call gets an empty set of the forward's own precomputed features
(`mm_encoder_outputs`): nothing is merged, and the language model runs on the text alone, as
Hugging Face's own `generate` runs it after the first step."""

from __future__ import annotations

import inspect
import typing

from torch import nn
from transformers.utils import ModelOutput


def merges_images_every_call(model: nn.Module) -> bool:
    """Whether the model's forward needs pixels on every call and takes precomputed features."""
    parameters = inspect.signature(model.forward).parameters
    pixels = parameters.get("pixel_values")
    return (
        pixels is not None
        and pixels.default is inspect.Parameter.empty
        and "mm_encoder_outputs" in parameters
    )


def _feature_class(model: nn.Module) -> type[ModelOutput]:
    """The output class of the model's get_image_features (its forward reads that class's fields)."""
    annotation = typing.get_type_hints(model.get_image_features).get("return")
    for candidate in typing.get_args(annotation) or (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, ModelOutput):
            return candidate
    raise TypeError(f"{type(model).__name__}.get_image_features names no ModelOutput it returns")


def allow_text_calls(model: nn.Module) -> nn.Module:
    """The model, its calls without pixels given no image features (a no-op for other families)."""
    if not merges_images_every_call(model):
        return model
    features, embedding = _feature_class(model), model.get_input_embeddings()

    def no_images(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args or kwargs.get("pixel_values") is not None or kwargs.get("mm_encoder_outputs") is not None:
            return args, kwargs
        weight = embedding.weight  # read at the call: the model may have moved or changed dtype
        empty = weight.new_zeros(0, weight.shape[1])  # [0 image tokens, H]
        return args, {
            **kwargs,
            "pixel_values": None,
            "mm_encoder_outputs": {"image": features(pooler_output=empty)},
        }

    model.register_forward_pre_hook(no_images, with_kwargs=True)
    return model

"""Families whose images become vocabulary ids: Chameleon's VQ-GAN encodes an image into a grid of
codebook entries, and each entry is a token id of the language model's vocabulary
(`vocabulary_map`'s `IMGIMG...` names), which the language model embeds as it embeds text. The VQ-GAN
lives inside the module export captures (ChameleonModel, beside the decoder layers), so the codes
are made before it: a forward pre-hook on the model writes each image's code ids over its `<image>`
placeholders in `input_ids` and drops the pixels. The captured language model then takes ids
alone, an image call the same graph as a text call; the VQ-GAN runs eager, as a vision tower does,
and the language model embeds the same ids Hugging Face's forward embeds (its image features are
the embeddings of these ids).
"""

from __future__ import annotations

from torch import nn

from pipeline.errors import StageFailure


def coder(model: nn.Module) -> nn.Module | None:
    """The module that turns pixels into code ids (`get_image_tokens`) and keeps the vocabulary map:
    the model or its inner model; None for a family whose images become features."""
    for module in (model, getattr(model, "model", None)):
        if (
            isinstance(module, nn.Module)
            and hasattr(module, "get_image_tokens")
            and hasattr(module, "vocabulary_mapping")
        ):
            return module
    return None


def tokens_per_image(config) -> int | None:
    """Codes an image becomes, from the VQ config: its resolution over the encoder's downsampling
    (one halving per channel multiplier after the first), squared; None without a VQ config."""
    vq = getattr(config, "vq_config", None)
    if vq is None:
        return None
    side = vq.resolution // 2 ** (len(vq.channel_multiplier) - 1)
    return side * side


def prepare(model: nn.Module) -> nn.Module:
    """The model with a call's pixels turned into code ids before its forward (a no-op for other
    families)."""
    encoder = coder(model)
    if encoder is None:
        return model
    image_token = encoder.vocabulary_mapping.image_token_id

    def to_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        pixels = kwargs.get("pixel_values")
        if args or pixels is None:
            return args, kwargs
        ids = kwargs["input_ids"]  # [B, S]
        places = ids == image_token
        codes = encoder.get_image_tokens(pixels)  # [images, codes an image], vocabulary ids
        if int(places.sum()) != codes.numel():
            raise StageFailure(
                f"{int(places.sum())} image tokens in the call and {codes.numel()} codes of its "
                f"{codes.shape[0]} image(s): the processor's image_seq_length differs from the VQ-GAN's"
            )
        ids = ids.masked_scatter(places, codes.to(ids.dtype))
        return args, {**kwargs, "input_ids": ids, "pixel_values": None}

    model.register_forward_pre_hook(to_ids, with_kwargs=True)
    return model

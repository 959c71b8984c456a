"""Images for VLM families the project has no code for: the family's image processor from
transformers sized by the vision config, the token count asked of the model (on the meta device),
and text-only requests, with a note, for a family whose images cannot be prepared."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_VLMS, build_tiny, compose_cfg

from pipeline.errors import ConfigError
from pipeline.models import images, meta, zoo
from pipeline.models.inputs import make_example_inputs
from pipeline.runtime.requests import Sources, build_requests


def _skeleton(name: str):
    cfg = compose_cfg([f"model={name}"])
    hf_config = zoo.build_hf_config(cfg.model)
    return hf_config, meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config)


@pytest.mark.parametrize("name", FAMILY_VLMS)
def test_image_tokens_are_what_the_model_makes_of_the_image(name):
    """The count asked of the meta-device model equals the features the real model computes from
    the same pixels, and the placeholder holds that many image tokens."""
    hf_config, skeleton = _skeleton(name)
    batch = images.preprocess(
        hf_config, [images.synthetic_image(80, torch.Generator().manual_seed(0))], torch.float32, torch.device("cpu"),
        None, skeleton,
    )  # fmt: skip
    side = hf_config.vision_config.image_size
    assert batch.kwargs["pixel_values"].shape[-2:] == (
        side,
        side,
    )  # the family's processor, sized by the config
    model, _, _ = build_tiny(name)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=batch.kwargs["pixel_values"])
    features = getattr(features, "pooler_output", features)
    rows = features[0].shape[0] if isinstance(features, list | tuple) else features.shape[1]
    assert batch.tokens_per_image == [rows]
    placeholder = batch.placeholder(images.image_token_id(hf_config), 0)
    assert placeholder.count(images.image_token_id(hf_config)) == rows


def test_a_family_whose_images_cannot_be_prepared_runs_text_only(monkeypatch):
    monkeypatch.setattr(images, "image_processor_class", lambda model_type: None)
    hf_config, skeleton = _skeleton("tiny_llava")
    examples = make_example_inputs(hf_config, 2, None, torch.float32, torch.device("cpu"), 0, skeleton)
    assert examples.image is None and "no image processor" in examples.note and "text-only" in examples.note
    cfg = compose_cfg(["model=tiny_llava", "prompt.batch_size=2", "prompt.prompt_len=16"])
    requests = build_requests(
        cfg.prompt, cfg.runtime, 0, hf_config, torch.float32, torch.device("cpu"), Sources(skeleton=skeleton)
    )
    assert all(not r.images and len(r.prompt) == 16 for r in requests)
    # asked for images explicitly: refused, naming why
    with pytest.raises(ConfigError, match="no image processor.*text-only"):
        images.preprocess(
            hf_config, [images.synthetic_image(56, torch.Generator())], torch.float32, torch.device("cpu")
        )

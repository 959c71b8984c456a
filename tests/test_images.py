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
    """The count asked of the meta-device model (or of a real run of its vision path, where that
    reads data) equals the features the real model computes from the same inputs, and the
    placeholder holds that many image tokens."""
    hf_config, skeleton = _skeleton(name)
    batch = images.preprocess(
        hf_config, [images.synthetic_image(80, torch.Generator().manual_seed(0))], torch.float32, torch.device("cpu"),
        None, skeleton,
    )  # fmt: skip
    processor = images.sized_processor(hf_config) if images.rule_of(hf_config) is None else None
    vision = hf_config.vision_config
    if processor is not None and getattr(processor, "merge_size", None):  # variable resolution
        assert (processor.patch_size, processor.merge_size) == (vision.patch_size, vision.spatial_merge_size)
    elif processor is not None:  # the family's processor, sized by the config
        side = images.size_pair(vision.image_size)
        assert tuple(batch.kwargs["pixel_values"].shape[-2:]) == side
    model, _, _ = build_tiny(name)
    with torch.no_grad():
        featurer = images.featurer(model)
        features = featurer.get_image_features(**images.taken(featurer.get_image_features, batch.kwargs))
    features = getattr(features, "pooler_output", features)
    if isinstance(features, list | tuple):
        rows = sum(f.shape[0] for f in features)
    else:  # [tiles of the one image, tokens, hidden]
        rows = features.shape[0] * features.shape[1]
    assert batch.tokens_per_image == [rows]
    placeholder = batch.placeholder(images.image_token_id(hf_config), 0)
    assert placeholder.count(images.image_token_id(hf_config)) == rows


def test_each_hand_written_rule_gives_what_the_generic_path_cannot():
    """The three image rules in models/images.PREPROCESS stay because the generic path (the
    family's image processor sized by the config, the count from the model) gives other inputs:
    Pixtral's processor keeps its own 16-pixel patch, not the config's patch * merge step (other
    pixel sizes); Qwen2-VL's leaves out the vision start and end tokens its processor's chat
    template writes around each image; Llama-4's image processor is torchvision's alone, which a
    torch without torchvision (`make setup TORCH=torch==2.13.0`) lacks."""
    image = images.synthetic_image(56, torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    hf_config, skeleton = _skeleton("tiny_mistral3")
    ruled = images.preprocess(hf_config, [image], torch.float32, cpu, None, skeleton)
    generic = images._fixed_size(hf_config, [image], None, skeleton)
    step = hf_config.vision_config.patch_size * hf_config.spatial_merge_size
    assert ruled.kwargs["pixel_values"].shape[-1] % step == 0
    assert generic.kwargs["pixel_values"].shape[-1] % step != 0

    hf_config, skeleton = _skeleton("tiny_qwen2_5_vl")
    ruled = images.preprocess(hf_config, [image], torch.float32, cpu, None, skeleton)
    generic = images._fixed_size(hf_config, [image], None, skeleton)
    assert ruled.prefix == [hf_config.vision_start_token_id] and generic.prefix == []

    import transformers

    assert images.image_processor_class("llama4") is transformers.Llama4ImageProcessor


def test_a_family_whose_images_cannot_be_prepared_is_refused_for_image_requests(monkeypatch):
    """Its checks are text-only (said so), and a workload whose requests carry images is refused
    naming why and what to give instead, never run as text."""
    monkeypatch.setattr(images, "image_processor_class", lambda model_type: None)
    hf_config, skeleton = _skeleton("tiny_llava")
    examples = make_example_inputs(hf_config, 2, None, torch.float32, torch.device("cpu"), 0, skeleton)
    assert examples.image is None and "no image processor" in examples.note and "text-only" in examples.note
    cfg = compose_cfg(["model=tiny_llava", "prompt.batch_size=2", "prompt.prompt_len=16"])
    with pytest.raises(ConfigError, match="no image processor.*prompt.queries"):
        build_requests(
            cfg.prompt,
            cfg.runtime,
            0,
            hf_config,
            torch.float32,
            torch.device("cpu"),
            Sources(skeleton=skeleton),
        )


def test_whether_a_model_takes_images_comes_from_its_class():
    """Fuyu embeds image patches with one linear layer and has no vision_config: still a VLM, its
    images cut into patches by its own rule; Chameleon (VQ codes, no vision_config) is a VLM whose
    images are sized by its VQ-GAN's resolution, and without a VQ config either its images are
    refused for want of sizes rather than left out; Gemma 3's text-only config is no VLM although
    Gemma 3 is a VLM family."""
    from transformers import ChameleonConfig, FuyuConfig, Gemma3TextConfig, LlamaConfig, Qwen3VLConfig

    assert zoo.is_vlm(FuyuConfig()) and getattr(FuyuConfig(), "vision_config", None) is None
    assert images.unsupported(FuyuConfig()) is None
    assert zoo.is_vlm(Qwen3VLConfig())
    assert not zoo.is_vlm(LlamaConfig()) and not zoo.is_vlm(Gemma3TextConfig())
    chameleon = ChameleonConfig()
    assert zoo.is_vlm(chameleon) and images.unsupported(chameleon) is None
    assert images.default_image_size(chameleon) == chameleon.vq_config.resolution
    chameleon.vq_config = None
    assert "no vision_config (nor vq_config)" in images.unsupported(chameleon)


@pytest.mark.parametrize("name", ["tiny_llava", "tiny_fuyu"])
def test_an_image_smaller_than_one_patch_is_refused_up_front(name, tmp_path):
    """A given image smaller than one 14-pixel patch (of the vision tower, or of the model's own
    patch embedding where it has no tower) is a config error naming it, before any model is built."""
    from PIL import Image

    from pipeline.runtime.requests import check_images

    path = tmp_path / "small.png"
    Image.new("RGB", (10, 10)).save(path)
    config = zoo.build_hf_config(compose_cfg([f"model={name}"]).model)
    with pytest.raises(
        ConfigError, match=r"prompt.images\[0\]=.*small.png is 10x10 pixels, smaller than one 14-pixel"
    ):
        check_images([str(path)], config)
    Image.new("RGB", (14, 14)).save(tmp_path / "one_patch.png")
    check_images([str(tmp_path / "one_patch.png")], config)


def test_fuyus_patches_are_its_processors():
    """Fuyu's images without its Processor (the generic layout, the export's example call): the
    patches, row by row, and their count equal what FuyuProcessor makes of the same image, with
    either flavour of its image processor (FuyuProcessor itself runs with the torchvision one)."""
    import transformers

    from pipeline.models.families import build_tokenizer

    config = zoo.build_hf_config(compose_cfg(["model=tiny_fuyu"]).model)
    image = images.synthetic_image(60, torch.Generator().manual_seed(0)).resize((90, 60))
    patch = {"height": 14, "width": 14}
    made = transformers.FuyuProcessor(
        image_processor=transformers.FuyuImageProcessor(patch_size=patch), tokenizer=build_tokenizer(config)
    )(text=["a"], images=[image], return_tensors="pt")
    for flavour in (transformers.FuyuImageProcessorPil, transformers.FuyuImageProcessor):
        batch = images.preprocess(
            config, [image], torch.float32, torch.device("cpu"), flavour(patch_size=patch)
        )
        assert batch.grids == [(5, 7)] and batch.tokens_per_image == [35]
        diff = (batch.kwargs["pixel_values"] - made["image_patches"]).abs().max()
        assert diff < 1e-6, (flavour, diff)


def test_images_reach_the_language_model_by_features_or_by_cross_attention():
    """A VLM's images become prompt tokens (get_image_features) or cross-attended vision states
    (a forward taking cross_attention_states, Mllama's); a model with neither is refused for image
    requests, saying so. Mllama's tiles are cut to the vision tower's max_num_tiles, one token each
    image."""
    from transformers import LlavaConfig, MllamaConfig

    assert zoo.takes_vision_states(MllamaConfig()) and not zoo.takes_vision_states(LlavaConfig())

    class Opaque(torch.nn.Module):
        def forward(self, input_ids, pixel_values=None):
            return input_ids

    assert "no get_image_features and takes no cross_attention_states" in images.unsupported(
        LlavaConfig(), model=Opaque()
    )
    from pipeline.models import cross_attention

    with pytest.raises(ConfigError, match="no cross-attention mask functions"):  # a processor without them
        cross_attention.token_mask("llava", [1, 2], 2, [1], 1)
    hf_config, skeleton = _skeleton("tiny_mllama")
    assert images.unsupported(hf_config, model=skeleton) is None
    batch = images.preprocess(
        hf_config, [images.synthetic_image(60, torch.Generator().manual_seed(0))], torch.float32,
        torch.device("cpu"), None, skeleton,
    )  # fmt: skip
    tiles = hf_config.vision_config.max_num_tiles
    assert batch.kwargs["pixel_values"].shape[:3] == (1, 1, tiles) and batch.tokens_per_image == [1]
    assert batch.kwargs["aspect_ratio_mask"].shape == (1, 1, tiles)


def test_image_sizes_are_read_whatever_shape_the_config_gives():
    """An int, [height, width] (InternVL's published configs), a dict, or none at all (a
    variable-resolution family): the synthetic image's side and the sized processor follow."""
    from types import SimpleNamespace

    from pipeline.models import images

    assert images.size_pair(448) == (448, 448) and images.size_pair([448, 336]) == (448, 336)
    assert images.size_pair({"height": 32, "width": 48}) == (32, 48)
    assert images.size_pair({"longest_edge": 364}) == (364, 364) and images.size_pair(None) is None
    with pytest.raises(ValueError, match="image size"):
        images.size_pair("big")
    listed = SimpleNamespace(
        model_type="llava", vision_config=SimpleNamespace(image_size=[56, 42], patch_size=14)
    )
    assert images.default_image_size(listed) == 56
    processor = images.sized_processor(listed)
    assert (processor.size["shortest_edge"], processor.crop_size["height"], processor.crop_size["width"]) == (
        42,
        56,
        42,
    )
    variable = SimpleNamespace(
        model_type="qwen2_vl", vision_config=SimpleNamespace(patch_size=14, spatial_merge_size=2)
    )
    assert images.default_image_size(variable) == 56
    # An edge given as a number (Aria's max_image_size, 980 by default): the vision config's size
    aria = SimpleNamespace(model_type="aria", vision_config=SimpleNamespace(image_size=490, patch_size=14))
    processor = images.sized_processor(aria)
    assert (processor.max_image_size, processor.min_image_size) == (490, 336)
    # A second tower sized by its own config (DeepSeek-VL hybrid's SAM: 1024 pixels by default)
    hybrid = SimpleNamespace(
        model_type="deepseek_vl_hybrid",
        vision_config=SimpleNamespace(image_size=32, patch_size=16),
        high_res_vision_config=SimpleNamespace(image_size=64, patch_size=16),
    )
    processor = images.sized_processor(hybrid)
    assert (processor.size, processor.high_res_size) == (
        {"height": 32, "width": 32},
        {"height": 64, "width": 64},
    )

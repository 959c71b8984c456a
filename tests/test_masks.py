"""Which tokens a family attends both ways: the spans a request carries, read three ways (from the
prompt, from the token_type_ids its processor returns, from the mask Hugging Face itself builds)
must agree."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from pipeline.graphs import find_language_models
from pipeline.models import masks, zoo


def _mask_hf_builds(model, hf_config, call) -> object:
    """The attention mask the model hands its language model for `call`."""
    seen = []
    path = find_language_models(model, zoo.text_config_of(hf_config))[0]
    hook = model.get_submodule(path).register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**call)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("name", ["tiny_gemma3", "tiny_paligemma"])
def test_spans_agree_with_the_mask_hugging_face_builds(name):
    model, hf_config, examples = build_tiny(name)
    call = examples.image
    from_hf = masks.blocks_from_mask(_mask_hf_builds(model, hf_config, call))  # [B, S, 2]
    assert from_hf is not None
    for row, prompt in enumerate(call["input_ids"].tolist()):
        spans = masks.bidirectional_spans(hf_config, prompt)
        expected = torch.tensor(masks.token_blocks(spans, 0, len(prompt)))
        assert torch.equal(from_hf[row], expected), (row, spans)
        assert call["token_type_ids"][row].tolist() == masks.token_type_ids(hf_config, prompt)
    assert torch.equal(masks.blocks_from_token_types(hf_config, call["token_type_ids"]), from_hf)
    if name == "tiny_gemma3":  # each image's own tokens, not the begin/end-of-image tokens around them
        image = hf_config.image_token_index
        assert all(
            all(p == image for p in prompt[s:e]) for s, e in masks.bidirectional_spans(hf_config, prompt)
        )
    else:  # PaliGemma: the whole prompt
        assert masks.bidirectional_spans(hf_config, prompt) == [(0, len(prompt))]


def test_a_causal_family_has_no_spans_and_hf_builds_no_blocks():
    model, hf_config, examples = build_tiny("tiny_llava")
    assert masks.token_type_ids(hf_config, [1, 2, 3]) is None
    assert masks.bidirectional_spans(hf_config, [1, 2, 3]) == []
    assert masks.blocks_from_mask(_mask_hf_builds(model, hf_config, examples.image)) is None


def test_a_prefix_past_paligemma2s_window_is_refused():
    """PaliGemma 2 ORs its prefix with the sliding window; the cached attention bounds it by the
    window: the two agree only while the prefix fits."""
    from transformers import PaliGemmaConfig

    config = PaliGemmaConfig(text_config={"model_type": "gemma2", "sliding_window": 8})
    assert masks.span_past_window(config, [(0, 8)]) is None
    assert "longer than the sliding window (8)" in masks.span_past_window(config, [(0, 9)])
    assert masks.span_past_window(build_tiny("tiny_paligemma")[1], [(0, 5000)]) is None  # Gemma 1: no window

"""The workarounds for upstream bugs (pipeline/models/upstream_fixes.py): Hugging Face's own model
runs with them on the release that has the bug, and they are applied only there."""

from __future__ import annotations

import torch
from conftest import build_tiny
from transformers.models.llama4.modeling_llama4 import Llama4CausalLMOutputWithPast

from pipeline.models import upstream_fixes


def test_llama4_forward_and_generate_run():
    # transformers 5.24.0 raises AttributeError (image_outputs) in every forward without the fix
    model, _, _ = build_tiny("tiny_llama4_scout")
    ids = torch.tensor([[5, 6, 7, 8]])
    assert model(input_ids=ids).logits.shape[:2] == (1, 4)
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_llama4_fix_only_where_the_bug_is():
    has_bug = "image_outputs" in Llama4CausalLMOutputWithPast.__dataclass_fields__
    assert ("llama4_image_outputs" in upstream_fixes.APPLIED) == has_bug

"""Partial capture matches eager for every tiny VLM (text-only and image calls, other batch and
sequence sizes); full capture matches for text models and fails, with its cause, for Mistral3."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_VLMS, TINY_TEXT, TINY_VLMS, build_tiny, capture_tiny, transform_context

from pipeline.export import graph_capture
from pipeline.graphs import find_language_models
from pipeline.models import zoo


def _logits(model, call):
    with torch.no_grad():
        return model(**call).logits


def _capture(model, hf_config, call, paths):
    return graph_capture.capture(model, paths, call)


# What each family's language model receives besides its embeddings and positions: Gemma 3 a dict
# of masks per layer type, PaliGemma the mask of its bidirectional prefix; LLaVA none (causal).
FAMILY_INPUTS = {
    "tiny_llava": ["inputs_embeds", "position_ids"],
    "tiny_gemma3": ["attention_mask", "inputs_embeds", "position_ids"],
    "tiny_paligemma": ["attention_mask", "inputs_embeds", "position_ids"],
    "tiny_qwen2_vl": ["inputs_embeds", "position_ids"],
    "tiny_llava_next": ["inputs_embeds", "position_ids"],
    "tiny_idefics3": ["inputs_embeds", "position_ids"],
    "tiny_internvl": ["inputs_embeds", "position_ids"],
    "tiny_aya_vision": ["inputs_embeds", "position_ids"],
    "tiny_smolvlm": ["inputs_embeds", "position_ids"],
    "tiny_llava_onevision": ["inputs_embeds", "position_ids"],
    "tiny_glm4v": ["inputs_embeds", "position_ids"],
    "tiny_qwen3_vl": ["deepstack_visual_embeds", "inputs_embeds", "position_ids", "visual_pos_masks"],
    "tiny_vipllava": ["inputs_embeds", "position_ids"],
    "tiny_deepseek_vl": ["inputs_embeds", "position_ids"],
    "tiny_paddleocr_vl": ["inputs_embeds", "position_ids"],
    "tiny_got_ocr2": ["inputs_embeds", "position_ids"],
    # the vision states, the tiles each token attends and the rows that attend any, from an image call
    "tiny_mllama": [
        "cross_attention_mask",
        "cross_attention_states",
        "full_text_row_masked_out_mask",
        "input_ids",
        "position_ids",
    ],
}


@pytest.mark.parametrize("name", [*FAMILY_VLMS, "tiny_mllama"])
def test_other_vlm_families_capture_their_language_model(name):
    """Gemma 3's mask mapping (a dict of tensors) becomes graph inputs through the pytree; the
    partly captured model computes what eager computed, with and without an image, and PaliGemma
    counts positions from 1 in a graph that defaults them."""
    model, hf_config, examples = build_tiny(name)
    calls = {"text": examples.text, "image": examples.image}
    reference = {k: _logits(model, c) for k, c in calls.items()}
    model, captured = capture_tiny(model, hf_config, examples)
    assert sorted(captured[0].tensor_inputs) == FAMILY_INPUTS[name]
    if name == "tiny_gemma3":
        assert set(captured[0].dynamic_dims) >= {
            "attention_mask_full_attention",
            "attention_mask_sliding_attention",
        }
    for key, call in calls.items():
        torch.testing.assert_close(_logits(model, call), reference[key], rtol=0, atol=1e-5, msg=key)


def test_paligemma_counts_positions_from_one():
    from pipeline.graphs import record_of
    from pipeline.models import probe

    model, hf_config, examples = build_tiny("tiny_paligemma")
    path = find_language_models(model, hf_config.text_config)[0]
    assert probe.first_position(model, path, examples.text["input_ids"]) == 1
    reference = _logits(model, examples.image)
    full, _ = capture_tiny(model, hf_config, examples, paths=[""])  # the graph defaults the positions
    assert record_of(full).position_offset == 1
    torch.testing.assert_close(_logits(full, examples.image), reference, rtol=0, atol=1e-5)
    text_model, text_config, text_examples = build_tiny("tiny_llama3_1_8b")
    stack = find_language_models(text_model, text_config)[0]
    assert probe.first_position(text_model, stack, text_examples.text["input_ids"]) == 0


def test_a_kwarg_that_cannot_be_an_input_is_named():
    from transformers import DynamicCache

    with pytest.raises(graph_capture.ExportError, match=r"transformers\..*DynamicCache.*use_cache=False"):
        graph_capture.RecordedCall({"past_key_values": DynamicCache()}).split()
    with pytest.raises(
        graph_capture.ExportError, match=r"'spans' is a builtins.dict holding int.*capture.submodules"
    ):
        graph_capture.RecordedCall({"spans": {"image": 3}}).split()
    inputs, constants, dropped = graph_capture.RecordedCall(
        {"mask": {"full": torch.ones(2), "sliding": None}, "flag": True, "none": None}
    ).split()
    assert list(inputs) == ["mask"] and constants == {"flag": True} and dropped == ["none"]


def _other_shapes(call: dict, vocab: int) -> dict:
    """Batch 1 and a longer sequence (40 tokens, past tiny Llama-4's attention chunk of 32)."""
    ids = torch.randint(20, vocab - 20, (1, 40))
    return {"input_ids": ids, "use_cache": False}


@pytest.mark.parametrize("name", TINY_VLMS)
def test_partial_capture_matches_eager(name):
    model, hf_config, examples = build_tiny(name)
    longer = _other_shapes(examples.text, zoo.text_config_of(hf_config).vocab_size)
    calls = {"text": examples.text, "image": examples.image, "longer": longer}
    reference = {k: _logits(model, c) for k, c in calls.items()}
    eager_vision = [n for n, _ in model.named_modules() if "vision" in n or "visual" in n]

    paths = find_language_models(model, zoo.text_config_of(hf_config))
    assert len(paths) == 1
    model, captured = _capture(model, hf_config, examples.image, paths)

    graph = model.get_submodule(paths[0])
    assert isinstance(graph, torch.fx.GraphModule)
    # kwargs-only, tensors as inputs; position ids made an input so a decode step can say where it is
    assert sorted(captured[0].tensor_inputs) == ["inputs_embeds", "position_ids"]
    assert captured[0].constants.get("use_cache") is False  # non-tensors baked in
    assert captured[0].dynamic_dims["inputs_embeds"] == {0: "batch", 1: "seq"}
    rope_dims = (
        {1: "batch", 2: "seq"} if name == "tiny_qwen2_5_vl" else {0: "batch", 1: "seq"}
    )  # mrope: [3, B, S]
    assert captured[0].dynamic_dims["position_ids"] == rope_dims
    assert not captured[0].notes  # nothing specialized
    # The vision tower stays eager, module by module.
    assert [n for n, _ in model.named_modules() if "vision" in n or "visual" in n] == eager_vision
    for key, call in calls.items():
        torch.testing.assert_close(_logits(model, call), reference[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("name", TINY_TEXT)
def test_full_capture_of_text_models_matches_eager(name):
    model, hf_config, examples = build_tiny(name)
    longer = _other_shapes(examples.text, hf_config.vocab_size)
    reference = {k: _logits(model, c) for k, c in {"text": examples.text, "longer": longer}.items()}
    captured_model, captured = _capture(model, hf_config, examples.text, [""])
    assert isinstance(captured_model, torch.fx.GraphModule)
    assert sorted(captured[0].tensor_inputs) == ["input_ids", "position_ids"]
    torch.testing.assert_close(_logits(captured_model, examples.text), reference["text"], rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(captured_model, longer), reference["longer"], rtol=0, atol=1e-5)


def test_full_capture_of_mistral3_fails_in_the_vision_tower():
    model, hf_config, examples = build_tiny("tiny_mistral3")
    with pytest.raises(graph_capture.ExportFailed) as info:
        _capture(model, hf_config, examples.image, [""])
    cause = info.value.__cause__
    assert "GuardOnDataDependentSymNode" in type(cause).__name__
    assert graph_capture.module_of_failure(cause, model).startswith("model.vision_tower")
    assert "def forward" in info.value.console  # torch's partial graph, kept for the logs


def test_positional_call_and_constant_mismatch():
    model, hf_config, examples = build_tiny("tiny_mistral3")
    path = find_language_models(model, hf_config.text_config)[0]
    embeds = model.get_input_embeddings()(examples.text["input_ids"])
    with torch.no_grad():
        expected = model.get_submodule(path)(inputs_embeds=embeds, use_cache=False).last_hidden_state
    model, _ = _capture(model, hf_config, examples.image, [path])
    graph = model.get_submodule(path)
    with torch.no_grad():
        # Positional (None for input_ids), extra None kwargs and the constant's own value are all fine.
        out = graph(None, attention_mask=None, inputs_embeds=embeds, use_cache=False, position_ids=None)
        torch.testing.assert_close(out.last_hidden_state, expected, rtol=0, atol=1e-5)
        with pytest.raises(graph_capture.ExportError, match="use_cache=False"):
            graph(inputs_embeds=embeds, use_cache=True)
        with pytest.raises(graph_capture.ExportError, match="without 'attention_mask'"):
            graph(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2]))
        # Explicit positions: shifted ones give other outputs (the graph does not bake in an arange).
        shifted = graph(
            inputs_embeds=embeds, position_ids=torch.arange(5, 5 + embeds.shape[1])[None].expand(2, -1)
        )
        assert not torch.allclose(shifted.last_hidden_state, expected)


def test_a_kwarg_the_module_does_not_read_is_not_baked_in():
    """LLaVA-OneVision's model passes the head's logits_to_keep down to its decoder stack, which has
    no head: export leaves it out, and generation's tensor form of it (the rows a packed step
    keeps) reaches the graph as well as the int the export saw. A kwarg the module reads stays a
    constant the call must match."""
    text_model = build_tiny("tiny_llama3_1_8b")[0]
    assert graph_capture.reads(text_model, "logits_to_keep")
    stack = text_model.model
    assert graph_capture.reads(stack, "output_attentions") and not graph_capture.reads(
        stack, "logits_to_keep"
    )
    # LLaVA's forward takes use_cache only in its **kwargs, which its language model names
    assert graph_capture.reads(build_tiny("tiny_llava")[0], "use_cache")
    model, hf_config, examples = build_tiny("tiny_llava_onevision")
    reference = _logits(model, examples.text)
    model, captured = capture_tiny(model, hf_config, examples)
    assert "logits_to_keep" in captured[0].unread and "logits_to_keep" not in captured[0].constants
    with torch.no_grad():
        kept = model(**examples.text, logits_to_keep=torch.tensor([3, 7])).logits
    torch.testing.assert_close(kept, reference[:, [3, 7]], rtol=0, atol=1e-5)


class _VisionStates(torch.nn.Module):
    """A language model that takes vision states beside its embeddings; `additive` adds them at the
    image tokens (DeepStack), otherwise a layer that runs only with them attends over them."""

    def __init__(self, additive: bool):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.additive = additive

    def forward(self, inputs_embeds, image_mask=None, states=None):  # [B, S, 8], [B, S], [N, 8]
        hidden = self.proj(inputs_embeds)
        if states is None:
            return hidden
        if self.additive:
            return hidden.masked_scatter(image_mask[..., None], hidden[image_mask] + states)
        # A layer that runs only with states: attention over them (no states: no weights), then its
        # MLP, which runs whatever the states (Mllama's cross-attention layers)
        weights = torch.softmax(hidden @ states.T, dim=-1)  # [B, S, N]
        hidden = hidden + weights @ states
        return hidden + self.proj(hidden)


class _ToyVLM(torch.nn.Module):
    def __init__(self, additive: bool):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(image_token_id=7)
        self.embed = torch.nn.Embedding(16, 8)
        self.vision = torch.nn.Linear(4, 8)
        self.language_model = _VisionStates(additive)

    def forward(self, input_ids, pixels=None):  # pixels: [N, 4], one row per image token
        embeds = self.embed(input_ids)
        if pixels is None:
            return self.language_model(inputs_embeds=embeds)
        return self.language_model(
            inputs_embeds=embeds, image_mask=input_ids == 7, states=self.vision(pixels)
        )


def _toy_calls(image_tokens: int) -> tuple[dict, dict]:
    ids = torch.randint(0, 7, (2, 11))
    ids[:, 2 : 2 + image_tokens // 2] = 7
    return {"input_ids": ids, "pixels": torch.randn(image_tokens, 4)}, {
        "input_ids": torch.randint(0, 7, (2, 11))
    }


def test_vision_inputs_of_a_language_model_are_empty_without_images():
    """Inputs only an image call gives the language model (Qwen3-VL's DeepStack features and their
    mask) become dynamic in the image-token count, and a call without images gets their empty
    form: the graph equals eager on an image call of another token count and on a text call."""
    torch.manual_seed(0)
    model = _ToyVLM(additive=True)
    image, text = _toy_calls(6)
    model, captured = graph_capture.capture(model, ["language_model"], image, 0, text)
    assert captured[0].dynamic_dims["states"] == {0: "image_tokens"}
    eager = _ToyVLM(additive=True)
    eager.load_state_dict(model.state_dict())
    other, _ = _toy_calls(10)
    for call in (other, text):
        with torch.no_grad():
            torch.testing.assert_close(model(**call), eager(**call), rtol=0, atol=1e-6)


def test_vision_inputs_whose_empty_form_differs_are_refused():
    """Cross-attention over no states is not the layer skipped (Mllama skips it without images):
    export refuses such a language model, naming its vision inputs."""
    image, text = _toy_calls(6)
    with pytest.raises(graph_capture.ExportError, match=r"\['image_mask', 'states'\].*capture=none"):
        graph_capture.capture(_ToyVLM(additive=False), ["language_model"], image, 0, text)


def test_graph_keeps_the_parents_interface_without_copying_weights():
    model, hf_config, examples = build_tiny("tiny_llama4_scout")
    embedding = model.get_input_embeddings()
    before = {id(p) for p in model.parameters()}
    paths = find_language_models(model, hf_config.text_config)
    assert paths == ["language_model.model"]  # the decoder stack, not the CausalLM around it
    model, _ = _capture(model, hf_config, examples.image, paths)
    assert model.get_input_embeddings() is embedding
    assert model.language_model.model.embed_tokens is embedding  # Llama-4 reads the attribute
    assert {id(p) for p in model.parameters()} == before


def test_eager_parts_lists_what_stays_eager():
    model, hf_config, examples = build_tiny("tiny_mistral3")
    assert graph_capture.eager_parts(model, ["model.language_model"]) == [
        "model.vision_tower",
        "model.multi_modal_projector",
        "lm_head",
    ]


def test_several_submodules_and_positional_callers():
    """capture.submodules may name more than one; lm_head is called positionally by its parent."""
    model, hf_config, examples = build_tiny("tiny_mistral3")
    reference = {k: _logits(model, c) for k, c in {"text": examples.text, "image": examples.image}.items()}
    model, captured = _capture(model, hf_config, examples.image, ["model.language_model", "lm_head"])
    assert [c.name for c in captured] == ["model.language_model", "lm_head"]
    assert captured[1].tensor_inputs == ["input"]  # nn.Linear.forward(input), bound by name
    for key, call in {"text": examples.text, "image": examples.image}.items():
        torch.testing.assert_close(_logits(model, call), reference[key], rtol=0, atol=1e-5)


def test_unknown_submodule_is_named():
    model, hf_config, examples = build_tiny("tiny_mistral3")
    with pytest.raises(graph_capture.ExportError, match="'model.language' is not a submodule"):
        graph_capture.record_calls(model, ["model.language"], examples.text)


def test_a_graph_keeps_its_exported_node_count_after_the_transforms():
    """The export line and the report's export table count the graph as export produced it; the
    transforms' record and the report's second column count it now."""
    from pipeline.transforms import registry

    model, hf_config, examples = build_tiny("tiny_llama3_1_8b")
    model, [captured] = capture_tiny(model, hf_config, examples)
    exported = captured.exported_nodes
    assert exported == captured.num_nodes == len(captured.graph_module.graph.nodes)
    cleanup = registry.TRANSFORMS["cleanup"](registry.TransformConfig())
    assert cleanup.rewrite_graph(captured.graph_module, transform_context()) > 0
    assert captured.exported_nodes == exported > captured.num_nodes

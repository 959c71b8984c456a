"""Transforms on tiny models: every attention/RoPE/RMSNorm/GEMM group matched, outputs unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODELS, TINY_VLMS, build_tiny, compose_cfg
from torch import fx, nn

from pipeline.errors import ConfigError
from pipeline.export import graph_capture
from pipeline.models import zoo
from pipeline.transforms import registry
from pipeline.transforms.onednn_linear import OneDNNLinear

# Per tiny model (2 text layers): attention layers, rotated tensors (q and k per RoPE layer),
# RMSNorms (2 per layer + final), residual adds fused into the norm after them (every norm but the
# first layer's input norm), fused GEMM groups (q/k/v and gate/up per layer), gated activations
# on a fused gate/up, and a cached attention per layer. Llama-4's second layer has no RoPE, its RoPE
# layer adds a weightless QK-norm, its gate/up is the shared expert's (with the router's columns),
# and its routed experts' gate/up (a chunked bmm) is a second gated activation per layer.
TWO_LAYERS = dict(
    match_attention=2,
    match_rope=4,
    match_rmsnorm=5,
    fuse_add_rmsnorm=4,
    fuse_gemms=4,
    fuse_silu_and_mul=2,
    insert_cached_attention=2,
)
EXPECTED = {name: TWO_LAYERS for name in TINY_MODELS} | {
    "tiny_llama4_scout": {**TWO_LAYERS, "match_rope": 2, "match_rmsnorm": 7, "fuse_silu_and_mul": 4}
}


def _captured(name: str, attn_implementation: str | None = None):
    """A tiny model with its language model (text models: the whole model) exported and swapped in."""
    cfg = compose_cfg([f"model={name}"])
    if attn_implementation:
        cfg.model.attn_implementation = attn_implementation
    hf_config = zoo.build_hf_config(cfg.model)
    from pipeline.models import build
    from pipeline.models.inputs import make_example_inputs

    model, _ = build.build_random(
        zoo.resolve_model_class(cfg.model, hf_config),
        hf_config,
        torch.float32,
        torch.device("cpu"),
        0,
        attn_implementation,
    )
    examples = make_example_inputs(hf_config, 2, None, torch.float32, torch.device("cpu"), 0)
    calls = {"text": examples.text} | ({"image": examples.image} if examples.image else {})
    with torch.no_grad():
        reference = {k: model(**c).logits for k, c in calls.items()}
    call = examples.image or examples.text
    paths = (
        graph_capture.find_language_models(model, zoo.text_config_of(hf_config)) if examples.image else [""]
    )
    model, _ = graph_capture.capture(model, paths, call)
    return model, calls, reference


def _assert_same(model, calls, reference, tol=1e-5):
    """Within tol of the largest logit (the wide tiny init makes logits of several units)."""
    with torch.no_grad():
        for key, call in calls.items():
            scale = max(1.0, reference[key].abs().max().item())
            torch.testing.assert_close(
                model(**call).logits, reference[key], rtol=0, atol=tol * scale, msg=key
            )


def _run(model, overrides=()):
    transforms = registry.parse(compose_cfg(list(overrides)).transforms)
    history = registry.TransformHistory()
    registry.run_transforms(model, transforms, history)
    return history


@pytest.mark.parametrize("name", TINY_MODELS)
def test_default_transforms_match_every_layer_and_keep_outputs(name):
    model, calls, reference = _captured(name)
    params = sum(p.numel() for p in model.parameters())
    history = _run(model)
    for transform, count in EXPECTED[name].items():
        assert history.matches(transform) == count, (transform, history.table())
    assert all(r.status == "applied" for r in history.records)
    assert sum(p.numel() for p in model.parameters()) == params  # fusion moves weights, adds none
    _assert_same(model, calls, reference)
    graph = registry.find_graphs(model)[0][1]
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "pipeline.rms_norm.default" in targets and "pipeline.add_rms_norm.default" in targets
    assert "pipeline.silu_and_mul.default" in targets and "aten.silu.default" not in targets
    assert "aten.scaled_dot_product_attention.default" not in targets
    assert "pipeline.cached_attention.default" in targets and "pipeline.attention.default" not in targets
    assert not any("_assert_tensor_metadata" in t for t in targets)


@pytest.mark.parametrize("name", TINY_VLMS)
def test_eager_attention_form_is_matched(name):
    model, calls, reference = _captured(name, attn_implementation="eager")
    history = _run(model)
    assert history.matches("match_attention") == 2
    _assert_same(model, calls, reference)


@pytest.mark.parametrize(
    "transform", ["cleanup", "match_attention", "match_rope", "match_rmsnorm", "fuse_gemms"]
)
@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_llama4_scout"])
def test_each_transform_alone_keeps_outputs(name, transform):
    model, calls, reference = _captured(name)
    others = [f"transforms.{t}.enabled=false" for t in EXPECTED[name] if t != transform]
    if transform != "cleanup":
        others.append("transforms.cleanup.enabled=false")
    history = _run(model, others)
    assert [r.status for r in history.records if r.transform == transform] == ["applied"]
    _assert_same(model, calls, reference)


def test_eager_attention_without_mask_and_with_division():
    class Attention(nn.Module):
        # q, k, v: [B, H, S, D]; the textbook form, no mask, scale as a division.
        def forward(self, q, k, v):
            scores = torch.matmul(q, k.transpose(-2, -1)) / 4.0
            return torch.matmul(torch.softmax(scores, dim=-1), v)

    q, k, v = (torch.randn(2, 4, 7, 16) for _ in range(3))
    gm = torch.export.export(Attention(), (q, k, v)).module()
    expected = Attention()(q, k, v)
    assert registry.TRANSFORMS["match_attention"](registry.TransformConfig()).apply_graph(gm) == 1
    torch.testing.assert_close(gm(q, k, v), expected, rtol=0, atol=1e-5)


def test_fuse_add_rmsnorm_only_where_the_sum_is_not_needed_sooner():
    """Fused: a residual add read by the norm and later; not fused: the sum read before the norm (the
    fused node stands at the norm), or an add that broadcasts."""
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    class Residual(nn.Module):
        def __init__(self, early_reader: bool):
            super().__init__()
            self.norm, self.early_reader = MistralRMSNorm(8), early_reader

        def forward(self, x, residual):  # [B, S, 8], [B, S, 8] or a broadcast [8]
            total = x + residual
            early = total * 2 if self.early_reader else total
            return self.norm(total) + early

    x = torch.randn(2, 3, 8)
    for module, residual, fused in (
        (Residual(False), torch.randn(2, 3, 8), 1),
        (Residual(True), torch.randn(2, 3, 8), 0),
        (Residual(False), torch.randn(8), 0),
    ):
        with torch.no_grad():
            module.norm.weight.uniform_(0.5, 1.5)
        gm = torch.export.export(module, (x, residual)).module()
        registry.TRANSFORMS["cleanup"](registry.TransformConfig()).apply_graph(gm)  # as the default list runs
        assert registry.TRANSFORMS["match_rmsnorm"](registry.TransformConfig()).apply_graph(gm) == 1
        assert registry.TRANSFORMS["fuse_add_rmsnorm"](registry.TransformConfig()).apply_graph(gm) == fused
        torch.testing.assert_close(gm(x, residual), module(x, residual), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("sizes", "pieces", "fused"),
    [([4, 4], (0, 1), 1), ([2, 4, 4], (1, 2), 1), ([4, 4, 4], (0, 2), 0), ([4, 4], (1, 0), 0)],
    ids=["halves", "after-other-columns", "not-neighbours", "up-first"],
)
def test_fuse_silu_and_mul_takes_gate_then_up_side_by_side(sizes, pieces, fused):
    class GatedActivation(nn.Module):
        def forward(self, gate_up):  # [B, sum(sizes)]
            split = gate_up.split(sizes, dim=-1)
            return F.silu(split[pieces[0]]) * split[pieces[1]]

    gate_up = torch.randn(3, sum(sizes))
    gm = torch.export.export(GatedActivation(), (gate_up,)).module()
    registry.TRANSFORMS["cleanup"](registry.TransformConfig()).apply_graph(gm)
    assert registry.TRANSFORMS["fuse_silu_and_mul"](registry.TransformConfig()).apply_graph(gm) == fused
    torch.testing.assert_close(gm(gate_up), GatedActivation()(gate_up), rtol=0, atol=0)


def test_transformed_graph_stays_exportable():
    """The rewritten graph exports again (canonical ops have fake kernels); the cached one takes
    runtime inputs, so it is left out here."""
    model, calls, _ = _captured("tiny_magistral")
    _run(model, ["transforms.insert_cached_attention.enabled=false"])
    ids = calls["text"]["input_ids"]
    call = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)}
    program = torch.export.export(model, (), call, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**call).logits, model(**call).logits)


class _Breaks(registry.Transform):
    """Rewrites half the graph, then raises: the case skip_on_error must undo."""

    name = "breaks_midway"

    def apply_graph(self, gm: fx.GraphModule) -> int:
        gm.register_parameter("junk", nn.Parameter(torch.zeros(1)))
        for node in list(gm.graph.nodes)[: len(gm.graph.nodes) // 2]:
            if node.op == "call_function" and not node.users:
                gm.graph.erase_node(node)
        raise RuntimeError("pattern went wrong")


def test_skip_on_error_leaves_the_graph_as_it_was(monkeypatch):
    monkeypatch.setitem(registry.TRANSFORMS, "breaks_midway", _Breaks)
    model, calls, reference = _captured("tiny_mistral3")
    graph = registry.find_graphs(model)[0][1]
    code = graph.code
    history = _run(model, ["transforms=none", "+transforms.breaks_midway={skip_on_error: true}"])
    record = history.records[0]
    assert record.status == "skipped" and "pattern went wrong" in record.reason
    assert graph.code == code and not hasattr(graph, "junk")
    _assert_same(model, calls, reference)
    with pytest.raises(registry.TransformFailed, match="pattern went wrong"):
        _run(model, ["transforms=none", "+transforms.breaks_midway={}"])


def test_capture_none_has_no_subgraph_to_transform():
    model, _, _ = build_tiny("tiny_mistral3")
    history = _run(model)
    assert {r.status for r in history.records} == {"no target"}
    assert "capture=none" in history.records[0].reason


def test_model_scope_rmsnorm_swaps_eager_modules():
    model, calls, reference = _captured("tiny_mistral3")
    history = _run(model, ["transforms=none", "+transforms.match_rmsnorm={scope: model}"])
    # The eager parts only (the language model is the graph): Pixtral's ln_pre + 2 per vision
    # layer, and the projector's norm.
    assert history.matches("match_rmsnorm") == 3 + 1
    assert not any(
        type(m).__name__.endswith("RMSNorm") and type(m).__name__ != "CanonicalRMSNorm"
        for m in model.modules()
    )
    _assert_same(model, calls, reference)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+transforms.fuse_everything={}", "transforms.fuse_everything is not a transform; known: cleanup"),
        ("transforms.fuse_gemms.min_group=abc", "transforms.fuse_gemms"),
        ("transforms.match_attention.scope=model", "does not fit: match_attention runs on subgraph"),
        ("transforms.cleanup.scope=everything", "use one of: model, subgraph"),
        ("+transforms.cleanup.colour=red", "transforms.cleanup"),
    ],
)
def test_bad_transform_config_is_a_config_error(override, message):
    with pytest.raises(ConfigError, match=message):
        registry.parse(compose_cfg([override]).transforms)


def test_switches_from_the_command_line():
    assert registry.parse(compose_cfg(["transforms=none"]).transforms) == []
    parsed = registry.parse(compose_cfg(["transforms.fuse_gemms.enabled=false"]).transforms)
    assert [t.name for t in parsed] == [
        "cleanup",
        "match_attention",
        "match_rope",
        "match_rmsnorm",
        "fuse_add_rmsnorm",
        "fuse_gemms",
        "fuse_silu_and_mul",
        "onednn_linear",
        "insert_cached_attention",
    ]
    assert not parsed[5].config.enabled
    model, _, _ = _captured("tiny_magistral")
    history = registry.TransformHistory()
    registry.run_transforms(model, parsed, history)
    assert history.records[5].status == "disabled"


@pytest.mark.parametrize("name", TINY_MODELS)
def test_onednn_linear_takes_every_linear_with_the_same_weights(name):
    model, calls, reference = _captured(name)
    vlm = not isinstance(model, fx.GraphModule)  # a VLM's lm_head stays eager
    lm_head_weight = model.get_output_embeddings().weight if vlm else None
    history = _run(model)
    assert history.matches("onednn_linear") > 0
    graph = registry.find_graphs(model)[0][1]
    assert not any(n.target is torch.ops.aten.linear.default for n in graph.graph.nodes)
    assert not any(type(m) is nn.Linear for m in model.modules())  # eager parts too (scope: model)
    if vlm:  # swapped, holding the very same Parameter
        assert isinstance(model.get_output_embeddings(), OneDNNLinear)
        assert model.get_output_embeddings().weight is lm_head_weight
    _assert_same(model, calls, reference)


@pytest.mark.parametrize(("dtype", "matches"), [(torch.float32, 1), (torch.bfloat16, 0), (torch.float16, 0)])
def test_onednn_linear_dtypes(dtype, matches):
    """float32 goes to oneDNN and matches F.linear; bfloat16 (F.linear is oneDNN already) and
    float16 stay F.linear."""
    linear = nn.Linear(32, 48).to(dtype)
    x = torch.randn(1, 5, 32, dtype=dtype)
    gm = torch.export.export(linear, (x,)).module()
    transform = registry.TRANSFORMS["onednn_linear"](registry.TransformConfig())
    assert transform.apply_graph(gm) == matches
    torch.testing.assert_close(gm(x), linear(x), rtol=1e-2, atol=1e-2)

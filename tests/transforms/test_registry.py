"""The registry on tiny models: the default list matches every layer and keeps outputs, each
transform alone keeps outputs, scopes (one or a list) run in a defined order, failures are undone
or reported, config mistakes are refused up front."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, build_tiny, compose_cfg, transform_context
from torch import fx, nn
from transform_helpers import EXPECTED, assert_same, captured, run

from pipeline.errors import ConfigError
from pipeline.graphs import find_graphs
from pipeline.transforms import registry


@pytest.mark.parametrize("name", TINY_MODELS)
def test_default_transforms_match_every_layer_and_keep_outputs(name):
    model, calls, reference = captured(name)
    params = sum(p.numel() for p in model.parameters())
    history = run(model)
    for transform, count in EXPECTED[name].items():
        assert history.matches(transform) == count, (transform, history.table())
    assert all(r.status == "applied" for r in history.records)
    assert sum(p.numel() for p in model.parameters()) == params  # fusion moves weights, adds none
    assert_same(model, calls, reference)
    graph = find_graphs(model)[0][1]
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "pipeline.rms_norm.default" in targets and "pipeline.add_rms_norm.default" in targets
    assert "pipeline.silu_and_mul.default" in targets and "aten.silu.default" not in targets
    assert "aten.scaled_dot_product_attention.default" not in targets
    assert "pipeline.cached_attention.default" in targets and "pipeline.attention.default" not in targets
    assert not any("_assert_tensor_metadata" in t for t in targets)


@pytest.mark.parametrize(
    "transform", ["cleanup", "match_attention", "match_rope", "match_rmsnorm", "match_moe", "fuse_gemms"]
)
@pytest.mark.parametrize("name", ["tiny_mistral3", "tiny_llama4_scout"])
def test_each_transform_alone_keeps_outputs(name, transform):
    model, calls, reference = captured(name)
    others = [f"transforms.{t}.enabled=false" for t in EXPECTED[name] if t != transform]
    if transform != "cleanup":
        others.append("transforms.cleanup.enabled=false")
    history = run(model, others)
    assert [r.status for r in history.records if r.transform == transform] == ["applied"]
    assert_same(model, calls, reference)


def test_a_list_of_scopes_runs_the_subgraph_pass_then_the_model_pass():
    """match_rmsnorm on [model, subgraph]: the graph's norms and the eager vision tower's, recorded
    as two passes, the subgraph one first whatever the list's order."""
    model, calls, reference = captured("tiny_mistral3")
    history = run(model, ["transforms=none", "+transforms.match_rmsnorm={scope: [model, subgraph]}"])
    passes = [(r.scope, r.target, r.matches) for r in history.records]
    # The graph: 2 norms per layer and the final one; the eager parts: Pixtral's ln_pre, 2 per
    # vision layer (1 layer), and the projector's norm.
    assert passes == [("subgraph", "model.language_model", 5), ("model", "model", 4)]
    graph = find_graphs(model)[0][1]
    assert sum(n.target is torch.ops.pipeline.rms_norm.default for n in graph.graph.nodes) == 5
    assert_same(model, calls, reference)


def test_transformed_graph_stays_exportable():
    """The rewritten graph exports again (canonical ops have fake kernels); the cached one takes
    runtime inputs, so it is left out here."""
    model, calls, _ = captured("tiny_magistral")
    run(model, ["transforms.insert_cached_attention.enabled=false"])
    ids = calls["text"]["input_ids"]
    call = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)}
    program = torch.export.export(model, (), call, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**call).logits, model(**call).logits)


class _Breaks(registry.Transform):
    """Rewrites half the graph, then raises: the case skip_on_error must undo."""

    name = "breaks_midway"

    def apply_graph(self, gm: fx.GraphModule, ctx: registry.TransformContext) -> int:
        gm.register_parameter("junk", nn.Parameter(torch.zeros(1)))
        for node in list(gm.graph.nodes)[: len(gm.graph.nodes) // 2]:
            if node.op == "call_function" and not node.users:
                gm.graph.erase_node(node)
        raise RuntimeError("pattern went wrong")


def test_skip_on_error_leaves_the_graph_as_it_was(monkeypatch):
    monkeypatch.setitem(registry.TRANSFORMS, "breaks_midway", _Breaks)
    model, calls, reference = captured("tiny_mistral3")
    graph = find_graphs(model)[0][1]
    code = graph.code
    history = run(model, ["transforms=none", "+transforms.breaks_midway={skip_on_error: true}"])
    record = history.records[0]
    assert record.status == "skipped" and "pattern went wrong" in record.reason
    assert graph.code == code and not hasattr(graph, "junk")
    assert_same(model, calls, reference)
    with pytest.raises(registry.TransformFailed, match="pattern went wrong"):
        run(model, ["transforms=none", "+transforms.breaks_midway={}"])


def test_capture_none_has_no_subgraph_to_transform():
    model, _, _ = build_tiny("tiny_mistral3")
    history = run(model)
    assert {r.status for r in history.records} == {"no target"}
    assert "capture=none" in history.records[0].reason


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+transforms.fuse_everything={}",
            "transforms.fuse_everything is not a transform; known: bf16_gemv, cleanup",
        ),
        ("transforms.fuse_gemms.min_group=abc", "transforms.fuse_gemms"),
        (
            "transforms.match_attention.scope=model",
            "match_attention cannot run on model; it runs on subgraph",
        ),
        ("transforms.match_attention.scope=[subgraph,model]", "cannot run on model"),
        ("transforms.cleanup.scope=everything", "use one of subgraph, model or a list"),
        ("transforms.cleanup.scope=[]", "transforms.cleanup.scope= is not a scope"),
        ("+transforms.cleanup.colour=red", "transforms.cleanup"),
        ("+transforms.insert_cached_attention.page_size=64", "transforms.insert_cached_attention"),
        ("transforms.shard.source=guess", "transforms.shard.source"),
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
        "match_moe",
        "shard",
        "fuse_add_rmsnorm",
        "fuse_gemms",
        "fuse_silu_and_mul",
        "onednn_linear",
        "bf16_gemv",
        "insert_cached_attention",
    ]
    assert not parsed[7].config.enabled  # fuse_gemms
    model, _, _ = captured("tiny_magistral")
    history = registry.TransformHistory()
    registry.run_transforms(model, parsed, transform_context(), history)
    assert next(r for r in history.records if r.transform == "fuse_gemms").status == "disabled"


def _declared_pairs() -> list[tuple[str, str]]:
    """(first, then) for every order a transform declares."""
    pairs = []
    for name, cls in registry.TRANSFORMS.items():
        pairs += [(other, name) for other in cls.after] + [(name, other) for other in cls.before]
    return sorted(set(pairs))


def test_declared_orders_name_registered_transforms_and_the_default_list_keeps_them():
    assert _declared_pairs() and all(
        a in registry.TRANSFORMS and b in registry.TRANSFORMS for a, b in _declared_pairs()
    )
    registry.parse(compose_cfg().transforms)  # the default order: no error


@pytest.mark.parametrize(("first", "then"), _declared_pairs())
def test_an_order_that_breaks_a_declared_constraint_is_refused_naming_both(first, then):
    default = dict(compose_cfg().transforms)
    registry.parse({first: default[first], then: default[then]})
    with pytest.raises(ConfigError, match=f"{first} must run before {then}.*transforms.{first} above"):
        registry.parse({then: default[then], first: default[first]})
    # a transform switched off constrains nothing
    registry.parse({then: {**default[then], "enabled": False}, first: default[first]})


def test_the_registry_finishes_every_graph_rewrite():
    """A transform leaves a dead node and an edited graph; the registry drops the node and
    recompiles, so the module runs what its graph says."""

    class Doubler(registry.Transform):
        name = "test_doubler"

        def apply_graph(self, gm, ctx):
            output = next(n for n in gm.graph.nodes if n.op == "output")
            value = output.args[0]
            with gm.graph.inserting_before(output):
                gm.graph.call_function(torch.neg, (value,))  # dead: nothing reads it
                doubled = gm.graph.call_function(torch.mul, (value, 2))
            output.args = (doubled,)
            return 1

    gm = fx.symbolic_trace(nn.Linear(3, 3))
    x = torch.randn(2, 3)
    expected = gm(x) * 2
    record = registry._apply_one(
        Doubler(registry.TransformConfig()), "subgraph", "g", gm, transform_context()
    )
    assert record.status == "applied" and record.matches == 1
    assert not any(n.target is torch.neg for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), expected)


def test_each_rewritten_module_is_named_with_the_pass_that_replaced_it():
    """Two model-scope passes each replace one eager linear: each module is named with its own pass
    (the comparison's "rewritten by"), not with every pass that matched anywhere."""

    def replacing(transform_name: str, child: str) -> type[registry.Transform]:
        class Replace(registry.Transform):
            name = transform_name
            scopes = ("model",)

            def apply_model(self, model, ctx):
                setattr(model, child, nn.Linear(3, 3))
                return 1

        return Replace

    model = nn.Module()
    model.graph = fx.symbolic_trace(nn.Linear(3, 3))
    model.a, model.b, model.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    config = registry.TransformConfig(scope="model")
    transforms = [replacing("test_replace_a", "a")(config), replacing("test_replace_b", "b")(config)]
    history = registry.TransformHistory()
    registry.run_transforms(model, transforms, transform_context(), history)
    assert [r.replaced for r in history.records] == [["a"], ["b"]]
    assert registry.rewritten_modules(model, history) == {"a": "test_replace_a", "b": "test_replace_b"}


def test_a_graph_rewrite_that_moves_work_between_modules_records_it():
    """On a tiny model's graph, fuse_add_rmsnorm moves each layer's residual add (the layer's own
    node) into the norm after it, in that layer: the record says so, per layer, and fuse_gemms's
    fused projections stay inside their attention and MLP (their moves go to the parent module)."""
    model, _, _ = captured("tiny_llama3_1_8b")
    history = run(model)
    moved = registry.moved_work(history)
    assert moved["model.layers.0"] == {"model.layers.0.post_attention_layernorm": "fuse_add_rmsnorm"}
    assert moved["model.layers.1"] == {
        "model.layers.1.input_layernorm": "fuse_add_rmsnorm",
        "model.layers.1.post_attention_layernorm": "fuse_add_rmsnorm",
    }
    assert moved["model.layers.0.self_attn.q_proj"] == {"model.layers.0.self_attn": "fuse_gemms"}
    assert not any(t.startswith("model.layers.1") for t in moved.get("model.layers.0", {}))

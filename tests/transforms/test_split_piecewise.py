"""split_piecewise: a cached graph is marked, not restructured, into static segments and the layout
segments between them (the attention plan and each cached attention: what depends on the step's
sequence layout); the graph still computes what Hugging Face's model does. The segments running
per token bucket are tests/test_piecewise.py's."""

from __future__ import annotations

import pytest
from conftest import TINY_MODELS, transform_context
from transform_helpers import assert_same, captured, run

from pipeline.graphs import SEGMENT, cached_graphs, record_of
from pipeline.transforms import registry
from pipeline.transforms.split_piecewise import SplitPiecewise, is_layout_op

LAYOUT = ("pipeline::attention_plan", "pipeline::cached_attention")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_cached_graph_is_cut_at_every_layout_op_and_computes_the_same(name):
    model, calls, reference = captured(name)
    run(model)  # the default transforms: the graph gets its cache
    ((path, graph),) = cached_graphs(model)
    nodes = len(graph.graph.nodes)
    history = registry.TransformHistory()
    registry.run_transforms(model, [SplitPiecewise()], transform_context(), history)
    segments = record_of(graph).segments
    # two decoder layers (the plan joins the first cached attention's segment); a whole model's
    # graph (a text model's) ends in its logits, a segment of their own
    head = ["head"] if path == "root" else []
    assert [s.kind for s in segments] == ["static", "layout", "static", "layout", "static", *head]
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target.__name__ != "getitem":
            assert (segments[node.meta[SEGMENT]].kind == "layout") == is_layout_op(node), node
            assert is_layout_op(node) == (node.target._schema.name in LAYOUT), node
    assert [node.meta[SEGMENT] for node in graph.graph.nodes if node.op == "call_function"] == sorted(
        node.meta[SEGMENT] for node in graph.graph.nodes if node.op == "call_function"
    )  # segments follow node order
    assert history.matches("split_piecewise") == 2 and len(graph.graph.nodes) == nodes
    assert_same(model, calls, reference)

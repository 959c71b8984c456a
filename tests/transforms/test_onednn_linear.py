"""onednn_linear: float32 linears on CPU run through oneDNN on the same weight Parameters, in the
graphs and (scope model) in the eager parts."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS
from torch import fx, nn
from transform_helpers import apply, assert_same, captured, run

from pipeline.graphs import find_graphs
from pipeline.transforms.onednn_linear import OneDNNLinear


@pytest.mark.parametrize("name", TINY_MODELS)
def test_onednn_linear_takes_every_linear_with_the_same_weights(name):
    model, calls, reference = captured(name)
    vlm = not isinstance(model, fx.GraphModule)  # a VLM's lm_head stays eager
    lm_head_weight = model.get_output_embeddings().weight if vlm else None
    history = run(model)
    assert history.matches("onednn_linear") > 0
    graph = find_graphs(model)[0][1]
    assert not any(n.target is torch.ops.aten.linear.default for n in graph.graph.nodes)
    assert not any(type(m) is nn.Linear for m in model.modules())  # eager parts too (scope: model)
    if vlm:  # swapped, holding the very same Parameter
        assert isinstance(model.get_output_embeddings(), OneDNNLinear)
        assert model.get_output_embeddings().weight is lm_head_weight
        passes = {r.scope for r in history.records if r.transform == "onednn_linear" and r.matches}
        assert passes == {"subgraph", "model"}
    assert_same(model, calls, reference)


@pytest.mark.parametrize(("dtype", "matches"), [(torch.float32, 1), (torch.bfloat16, 0), (torch.float16, 0)])
def test_onednn_linear_dtypes(dtype, matches):
    """float32 goes to oneDNN and matches F.linear; bfloat16 (F.linear is oneDNN already) and
    float16 stay F.linear."""
    linear = nn.Linear(32, 48).to(dtype)
    x = torch.randn(1, 5, 32, dtype=dtype)
    gm = torch.export.export(linear, (x,)).module()
    assert apply("onednn_linear", gm) == matches
    torch.testing.assert_close(gm(x), linear(x), rtol=1e-2, atol=1e-2)

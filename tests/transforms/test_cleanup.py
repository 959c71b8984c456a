"""cleanup: export's own asserts and the operations that change nothing (a full-range slice, x + 0,
x * 1.0, a cast to x's dtype, a view to x's shape) leave the graph; anything that changes a value
stays."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS
from torch import nn
from transform_helpers import apply, assert_same, captured, run


class NoOps(nn.Module):
    """x: [B, S, D]; every step below but the last is the identity."""

    def forward(self, x):
        y = x[:, 0:]  # a full-range slice
        y = y + 0
        y = y * 1.0
        y = y.to(x.dtype)
        y = y.view(x.shape)
        return y * 2.0  # changes the value: stays


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_what_changes_nothing_goes_and_what_changes_a_value_stays():
    x = torch.randn(2, 3, 4)
    gm = torch.export.export(NoOps(), (x,)).module()
    before = _ops(gm)
    removed = apply("cleanup", gm)
    after = _ops(gm)
    assert removed >= 4 and len(after) < len(before)
    assert [t for t in after if "mul" in t] == ["aten.mul.Tensor"]  # the * 2.0 alone
    assert not any(t.startswith(("aten.slice", "aten.add", "aten.view", "aten._assert")) for t in after)
    torch.testing.assert_close(gm(x), NoOps()(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_tiny_models_graph_computes_the_same_after_cleanup(name):
    model, calls, reference = captured(name)
    history = run(model, ["transforms=none", "+transforms.cleanup={}"])
    assert history.matches("cleanup") > 0
    assert_same(model, calls, reference, tol=0)

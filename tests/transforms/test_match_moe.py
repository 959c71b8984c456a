"""match_moe: each mixture-of-experts layer's routed experts become one pipeline::moe, the router
and shared expert stay the model's own, and the logits stay the eager model's."""

from __future__ import annotations

import pytest
from conftest import TINY_MOE
from transform_helpers import assert_same, captured, run

from pipeline.graphs import find_graphs


def _targets(model) -> list[str]:
    graph = find_graphs(model)[0][1]
    return [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", ["tiny_llama4_scout", *TINY_MOE])
def test_every_moe_layer_becomes_one_op_and_logits_stay(name):
    model, calls, reference = captured(name)
    history = run(model)
    assert history.matches("match_moe") == 2, history.table()  # both layers are sparse
    record = next(r for r in history.records if r.transform == "match_moe")
    assert record.unmatched == []
    targets = _targets(model)
    assert targets.count("pipeline.moe.default") == 2
    # nothing of the all-experts form is left: no batched or grouped expert GEMMs
    assert not any(t in targets for t in ("aten.bmm.default", "aten._grouped_mm.default"))
    assert not any("grouped_mm" in t for t in targets)
    # nor the grouped form's bookkeeping (expert sort, histogram, inverse permutation)
    assert not any(
        t in targets for t in ("aten.sort.default", "aten.histc.default", "aten.index_put_.default")
    )
    assert "aten.topk.default" in targets  # the router is the model's own
    assert_same(model, calls, reference)


def test_without_match_moe_the_experts_stay_and_are_reported():
    model, calls, reference = captured("tiny_llama4_scout")
    history = run(model, ["transforms.match_moe.enabled=false"])
    assert history.matches("match_moe") == 0
    assert "aten.bmm.default" in _targets(model)
    assert_same(model, calls, reference)

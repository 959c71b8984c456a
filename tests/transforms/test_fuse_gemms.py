"""fuse_gemms: the eager modules the graph replaced keep their weights as views of the fused one."""

from __future__ import annotations

import torch
from conftest import staged

from pipeline.graphs import eager_graphs
from pipeline.runner import advance


def test_replaced_weights_become_views_of_the_fused_weight():
    with staged(["model=tiny_mistral3"], "load") as state:
        attention = state.model.model.language_model.layers[0].self_attn
        q, k = attention.q_proj.weight, attention.k_proj.weight
        before = (q.clone(), k.clone())
        advance(state, "transforms")
        fused = next(p for n, p in state.model.named_parameters() if "fused_q_proj_k_proj_v_proj" in n)
        with eager_graphs(state.model) as eager:
            eager_attention = eager.model.language_model.layers[0].self_attn
            assert eager_attention.q_proj.weight is q  # the eager module is back, with its own Parameter
            assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # same values
            assert q.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()  # no second copy
            assert torch.equal(torch.cat([q, k, eager_attention.v_proj.weight]), fused)

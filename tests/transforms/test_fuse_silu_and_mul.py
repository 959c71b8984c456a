"""fuse_silu_and_mul: silu(gate) * up on side-by-side pieces of one output becomes one op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transform_helpers import apply


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
    apply("cleanup", gm)
    assert apply("fuse_silu_and_mul", gm) == fused
    torch.testing.assert_close(gm(gate_up), GatedActivation()(gate_up), rtol=0, atol=0)

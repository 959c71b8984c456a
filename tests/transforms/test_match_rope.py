"""match_rope: the rotate-half form (x * cos + rotate_half(x) * sin) and Llama-4's complex form
become pipeline::rope / pipeline::rope_complex, one per rotated tensor, computing what they
replaced; a form that only looks like it stays."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS
from torch import nn
from transform_helpers import EXPECTED, apply, assert_same, captured, run

ROPE_OPS = ("pipeline.rope.default", "pipeline.rope_complex.default")


class RotateHalf(nn.Module):
    """q: [B, H, S, D], cos/sin: [B, 1, S, D]."""

    def __init__(self, sign: float = -1.0):
        super().__init__()
        self.sign = sign

    def forward(self, q, cos, sin):
        half = q.shape[-1] // 2
        high = -q[..., half:] if self.sign < 0 else q[..., half:]
        return q * cos + torch.cat([high, q[..., :half]], dim=-1) * sin


def _inputs():
    q = torch.randn(2, 4, 5, 16)
    angles = torch.randn(2, 1, 5, 8)
    emb = torch.cat([angles, angles], dim=-1)
    return q, emb.cos(), emb.sin()


def test_rotate_half_becomes_one_rope_op_computing_the_same():
    q, cos, sin = _inputs()
    gm = torch.export.export(RotateHalf(), (q, cos, sin)).module()
    apply("cleanup", gm)
    assert apply("match_rope", gm) == 1
    assert sum(str(n.target) == ROPE_OPS[0] for n in gm.graph.nodes) == 1
    assert not any("neg" in str(n.target) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(q, cos, sin), RotateHalf()(q, cos, sin), rtol=0, atol=1e-6)


def test_a_rotation_of_the_other_sign_is_not_rope():
    """cat([x2, x1]) without the negation is another function: left as it is."""
    q, cos, sin = _inputs()
    gm = torch.export.export(RotateHalf(sign=1.0), (q, cos, sin)).module()
    apply("cleanup", gm)
    assert apply("match_rope", gm) == 0
    torch.testing.assert_close(gm(q, cos, sin), RotateHalf(sign=1.0)(q, cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_every_rotated_tensor_of_a_tiny_model_is_matched(name):
    """q and k of each RoPE layer (Llama-4: its complex form, and none on its no-RoPE layer); the
    logits stay Hugging Face's."""
    model, calls, reference = captured(name)
    history = run(model, ["transforms=none", "+transforms.cleanup={}", "+transforms.match_rope={}"])
    assert history.matches("match_rope") == EXPECTED[name]["match_rope"]
    graphs = [m for m in model.modules() if isinstance(m, torch.fx.GraphModule)]
    ops = sum(str(n.target) in ROPE_OPS for gm in graphs for n in gm.graph.nodes)
    assert ops == EXPECTED[name]["match_rope"]
    assert_same(model, calls, reference)

"""match_attention: SDPA and the eager softmax(QK^T) V forms become pipeline::attention."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VLMS
from torch import nn
from transform_helpers import apply, assert_same, captured, run


@pytest.mark.parametrize("name", TINY_VLMS)
def test_eager_attention_form_is_matched(name):
    model, calls, reference = captured(name, attn_implementation="eager")
    history = run(model)
    assert history.matches("match_attention") == 2
    assert_same(model, calls, reference)


def test_eager_attention_without_mask_and_with_division():
    class Attention(nn.Module):
        # q, k, v: [B, H, S, D]; the textbook form, no mask, scale as a division.
        def forward(self, q, k, v):
            scores = torch.matmul(q, k.transpose(-2, -1)) / 4.0
            return torch.matmul(torch.softmax(scores, dim=-1), v)

    q, k, v = (torch.randn(2, 4, 7, 16) for _ in range(3))
    gm = torch.export.export(Attention(), (q, k, v)).module()
    expected = Attention()(q, k, v)
    assert apply("match_attention", gm) == 1
    torch.testing.assert_close(gm(q, k, v), expected, rtol=0, atol=1e-5)

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


def test_logit_softcapping_is_matched_with_its_cap():
    """Gemma 2's eager attention caps its scores (tanh(s / cap) * cap): the canonical op carries the
    cap, the graph still computes what eager computed."""
    model, calls, reference = captured("tiny_gemma2")
    history = run(model)
    assert history.matches("match_attention") == 2
    attention = [n for n in model.graph.nodes if n.target == torch.ops.pipeline.cached_attention.default]
    assert [n.args[13] for n in attention] == [2.0, 2.0]  # softcap, from the config's attn_logit_softcapping
    assert not any(r.unmatched for r in history.records if r.transform == "match_attention")
    assert_same(model, calls, reference)


def test_an_unmatched_attention_says_where_its_pattern_stopped():
    from conftest import transform_context

    from pipeline.transforms import registry

    class ClampedAttention(nn.Module):
        # a form no matcher knows: the scores clamped before the softmax
        def forward(self, q, k, v):
            scores = torch.matmul(q, k.transpose(-2, -1)) * 0.25
            return torch.matmul(torch.softmax(scores.clamp(max=5.0), dim=-1), v)

    q, k, v = (torch.randn(2, 4, 7, 16) for _ in range(3))
    gm = torch.export.export(ClampedAttention(), (q, k, v)).module()
    history = registry.TransformHistory()
    transform = registry.TRANSFORMS["match_attention"](registry.TransformConfig())
    registry.run_transforms(gm, [transform], transform_context(), history)
    record = history.records[0]
    assert record.status == "applied" and record.matches == 0
    assert "clamp" in record.reason and record.reason.startswith("nothing matched: softmax")
    assert len(record.unmatched) == 1


def test_generate_names_the_transform_report_when_nothing_was_cached():
    from types import SimpleNamespace

    from pipeline.stages.generate import _why_no_cache
    from pipeline.transforms.registry import TransformHistory, TransformRecord

    history = TransformHistory(
        [
            TransformRecord(
                "match_attention", "root", "applied", reason="nothing matched: softmax in x: clamp"
            ),
            TransformRecord("insert_cached_attention", "root", "applied"),
        ]
    )
    why = _why_no_cache(SimpleNamespace(transform_history=history))
    assert "transforms.match_attention matched nothing" in why and "transforms/report.json" in why
    assert "clamp" in why and "enable" not in why
    history.records[0].status = "disabled"
    assert "is not enabled" in _why_no_cache(SimpleNamespace(transform_history=history))

"""match_attention: every attention, whatever its spelling, becomes one `pipeline::attention` op.

Recognised forms (q: [B, H, S, D]; k, v: [B, Hkv, S, D]):
- `aten.scaled_dot_product_attention(q, k, v, mask, scale=...)`, HF's sdpa path;
- the eager path: `softmax(matmul(q, k.transpose(-2, -1)) * scale [+ mask], -1) [-> to] [-> dropout] @ v`;
- in either, the repeat_kv expansion in front of k and v
  (`unsqueeze(2) -> expand([B, Hkv, n_rep, S, D]) -> reshape([B, H, S, D])`) is looked through, so
  the canonical op gets the un-repeated KV heads and GQA stays explicit.
The mask (bool or additive) is passed through as HF built it: sliding windows and Llama-4's chunked
attention live in it.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import aten, finish, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, register

ATTENTION = torch.ops.pipeline.attention.default


def unrepeat_kv(node: fx.Node) -> fx.Node:
    """k or v before HF's repeat_kv, or the node itself when it was not repeated."""
    if not is_op(node, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return node
    expand = node.args[0]
    if not is_op(expand, aten.expand.default):
        return node
    unsqueeze = expand.args[0]
    if not (is_op(unsqueeze, aten.unsqueeze.default) and unsqueeze.args[1] == 2):
        return node
    return unsqueeze.args[0]


def _head_dim(q: fx.Node) -> int | None:
    value = q.meta.get("val")
    return int(value.shape[-1]) if value is not None and isinstance(value.shape[-1], int) else None


def _skip_casts(node: fx.Node) -> fx.Node:
    while is_op(node, aten.to.dtype, aten.dropout.default, aten.type_as.default):
        node = node.args[0]
    return node


def _match_eager(out: fx.Node):
    """out = matmul(probs, v): returns (q, k, v, mask, scale) or None."""
    probs, v = out.args[0], out.args[1]
    softmax = _skip_casts(probs)
    if not is_op(softmax, aten.softmax.int, aten._softmax.default) or softmax.args[1] not in (-1, 3):
        return None
    scores, mask = softmax.args[0], None
    if is_op(scores, aten.add.Tensor) and isinstance(scores.args[1], fx.Node):
        scores, mask = scores.args
    scale = 1.0
    if is_op(scores, aten.mul.Tensor, aten.div.Tensor) and isinstance(scores.args[1], float | int):
        scale = float(scores.args[1]) if scores.target == aten.mul.Tensor else 1.0 / float(scores.args[1])
        scores = scores.args[0]
    if not is_op(scores, aten.matmul.default):
        return None
    q, kt = scores.args
    if not (is_op(kt, aten.transpose.int) and sorted(a % 4 for a in kt.args[1:]) == [2, 3]):
        return None
    return q, kt.args[0], v, mask, scale


@register
class MatchAttention(Transform):
    name = "match_attention"

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            if is_op(node, aten.scaled_dot_product_attention.default):
                q, k, v = node.args[:3]
                mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
                dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
                is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
                scale = node.kwargs.get("scale")
                if scale is None and _head_dim(q):
                    scale = 1 / math.sqrt(_head_dim(q))  # SDPA's default
                if dropout or scale is None:
                    continue  # training-time dropout, or no static head dim: leave it
            elif is_op(node, aten.matmul.default) and (found := _match_eager(node)):
                q, k, v, mask, scale = found
                is_causal = False
            else:
                continue
            with gm.graph.inserting_before(node):
                canonical = gm.graph.call_function(
                    ATTENTION, (q, unrepeat_kv(k), unrepeat_kv(v), mask, float(scale), bool(is_causal))
                )
            replace(node, canonical)
            gm.graph.erase_node(node)
            matches += 1
        finish(gm)
        return matches

"""match_attention: every attention, whatever its spelling, becomes one `pipeline::attention` op.

Recognised forms (q: [B, H, S, D]; k, v: [B, Hkv, S, D]):
- `aten.scaled_dot_product_attention(q, k, v, mask, scale=...)`, HF's sdpa path;
- the eager path: `softmax(cap(matmul(q, k.transpose(-2, -1)) * scale) [+ mask], -1) [-> to] [-> dropout] @ v`,
  where cap is nothing or Gemma 2's logit soft-capping `tanh(s / cap) * cap`;
- in either, the repeat_kv expansion in front of k and v
  (`unsqueeze(2) -> expand([B, Hkv, n_rep, S, D]) -> reshape([B, H, S, D])`) is looked through, so
  the canonical op gets the un-repeated KV heads and GQA stays explicit.
The mask (bool or additive) is passed through as HF built it: sliding windows and Llama-4's chunked
attention live in it. The scale is the graph's constant, which the model took from its config
(`query_pre_attn_scalar` for the Gemmas). A softmax left unmatched is explained in the transform's
record (`unmatched`): the op where the pattern stopped.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import aten, is_op, replace
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


def _is_softmax(node) -> bool:
    return is_op(node, aten.softmax.int, aten._softmax.default) and node.args[1] in (-1, 3)


def _softcap(scores: fx.Node) -> tuple[fx.Node, float]:
    """`mul(tanh(div(s, cap)), cap)` -> (s, cap); anything else -> (scores, 0.0)."""
    if not (is_op(scores, aten.mul.Tensor) and isinstance(scores.args[1], float | int)):
        return scores, 0.0
    tanh = scores.args[0]
    if not is_op(tanh, aten.tanh.default) or not is_op(tanh.args[0], aten.div.Tensor):
        return scores, 0.0
    inner, cap = tanh.args[0].args
    if not isinstance(cap, float | int) or float(cap) != float(scores.args[1]):
        return scores, 0.0
    return inner, float(cap)


def _match_eager(out: fx.Node) -> tuple[tuple | None, str]:
    """out = matmul(probs, v): ((q, k, v, mask, scale, softcap), "") or (None, where it stopped)."""
    probs, v = out.args[0], out.args[1]
    softmax = _skip_casts(probs)
    if not _is_softmax(softmax):
        return None, f"{out.name}'s left operand is {_op_name(softmax)}, not a softmax over the last dim"
    scores, mask = softmax.args[0], None
    if is_op(scores, aten.add.Tensor) and isinstance(scores.args[1], fx.Node):
        scores, mask = scores.args
    scores, softcap = _softcap(scores)
    scale = 1.0
    if is_op(scores, aten.mul.Tensor, aten.div.Tensor) and isinstance(scores.args[1], float | int):
        scale = float(scores.args[1]) if scores.target == aten.mul.Tensor else 1.0 / float(scores.args[1])
        scores = scores.args[0]
    if not is_op(scores, aten.matmul.default):
        return None, (
            f"{softmax.name}'s scores come from {_op_name(scores)}, where "
            "matmul(q, k^T) [* scale] [capped by tanh] [+ mask] was expected"
        )
    q, kt = scores.args
    if not (is_op(kt, aten.transpose.int) and sorted(a % 4 for a in kt.args[1:]) == [2, 3]):
        return (
            None,
            f"{scores.name} multiplies q by {_op_name(kt)}, not by k transposed over its last two dims",
        )
    return (q, kt.args[0], v, mask, scale, softcap), ""


def _op_name(node) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    return str(node.target) if node.op == "call_function" else f"{node.op} {node.name}"


def _module_of(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[-1][0] if stack else "?"


def _sdpa_args(node: fx.Node) -> tuple[tuple | None, str]:
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    scale = node.kwargs.get("scale")
    if scale is None and _head_dim(q):
        scale = 1 / math.sqrt(_head_dim(q))  # SDPA's default
    if dropout:
        return None, f"{node.name} has dropout {dropout} (a training-time call)"
    if scale is None:
        return None, f"{node.name} has no scale and no static head dim to take SDPA's default from"
    return (q, k, v, mask, float(scale), bool(is_causal)), ""


@register
class MatchAttention(Transform):
    name = "match_attention"
    decoding = True

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            if is_op(node, aten.scaled_dot_product_attention.default):
                found, _ = _sdpa_args(node)
                if found is None:
                    continue
                q, k, v, mask, scale, is_causal = found
                softcap = 0.0
            elif is_op(node, aten.matmul.default) and _is_softmax(_skip_casts(node.args[0])):
                found, _ = _match_eager(node)
                if found is None:
                    continue
                q, k, v, mask, scale, softcap = found
                is_causal = False
            else:
                continue
            with gm.graph.inserting_before(node):
                canonical = gm.graph.call_function(
                    ATTENTION,
                    (q, unrepeat_kv(k), unrepeat_kv(v), mask, float(scale), bool(is_causal), float(softcap)),
                )
            replace(node, canonical)
            gm.graph.erase_node(node)
            matches += 1
        # A dropout is not dead code to fx (it draws random numbers), so a matched eager attention's
        # softmax -> dropout chain would stay behind: drop dropouts nothing reads.
        for node in reversed(list(gm.graph.nodes)):
            if is_op(node, aten.dropout.default) and not node.users:
                gm.graph.erase_node(node)
        return matches

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        """The attention-like nodes left (SDPA calls, softmaxes over the last dim), each with the
        module it is in and where its pattern stopped."""
        left = []
        for node in gm.graph.nodes:
            if is_op(node, aten.scaled_dot_product_attention.default):
                left.append(f"{node.name} in {_module_of(node)}: {_sdpa_args(node)[1]}")
            elif _is_softmax(node):
                users = [u for u in _users_through_casts(node) if is_op(u, aten.matmul.default)]
                reason = (
                    _match_eager(users[0])[1]
                    if users
                    else f"{node.name}'s probabilities are not multiplied by values (users: "
                    f"{', '.join(_op_name(u) for u in node.users)})"
                )
                left.append(f"{node.name} in {_module_of(node)}: {reason}")
        return left


def _users_through_casts(node: fx.Node) -> list[fx.Node]:
    found = []
    for user in node.users:
        if is_op(user, aten.to.dtype, aten.dropout.default, aten.type_as.default):
            found += _users_through_casts(user)
        else:
            found.append(user)
    return found

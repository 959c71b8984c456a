"""match_moe: a mixture-of-experts layer's routed experts become one `pipeline::moe`, which reads
only the experts each token was routed to.

Hugging Face runs every expert on every token and zeroes the unrouted ones (Llama-4: 8.1 of the
10.9 GB a Scout decode step reads are expert weights, of which a token routed to 1 of 16 experts
needs 1/16). The router (its logits, top-k, normalisation: the model's own numerics, so the
correctness check's routing-flip accounting keeps working), a shared expert and the residual stay
as they are; only the experts' computation from the routing weights to the sum over experts is
replaced.

Graph forms (torch.export of transformers 5.x, aten level):

- Llama-4 (`Llama4TextMoe`): the router's dense scores `s = sigmoid(scatter(full(-inf), topk))`
  [T, E]; `bmm(view(repeat(x, [E, 1]) * reshape(transpose(s, 0, 1), [-1, 1]), [E, -1, H]), W_gu)`
  with W_gu [E, H, 2I]; `chunk(2, -1)` -> `up * silu(gate)`; `bmm(., W_d)` with W_d [E, I, H];
  `view([-1, H])`, `reshape([E, -1, H])`, `sum([0])`. The routing weight scales the expert's
  input (`weights_on_input`); the k weights of a token are `gather(s, 1, topk indices)`.
- Mixtral, Qwen3-MoE (`@use_experts_implementation`, transformers' default "grouped_mm" form): the
  router's `top_k_index` and `top_k_weights` [T, k] flattened; `sort` of the expert ids gives
  `perm`; the tokens `x[perm // k]`; `grouped(x_g, transpose(W_gu), offsets)` with W_gu
  [E, 2I, H] (`aten._grouped_mm`, or `transformers::grouped_mm_fallback` where Inductor cannot take
  it: float32); `chunk(2, -1)` -> `silu(gate) * up`; `grouped(., transpose(W_d), offsets)` with W_d
  [E, H, I]; times `unsqueeze(weights[perm], -1)`; back in token order through `[inv_perm]`;
  `view([T, k, H])`, `sum([1])`. The routing weight scales the expert's output.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import aten, drop_dead, fake_value, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, register

MOE = torch.ops.pipeline.moe.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _param(node, dims: int) -> torch.Tensor | None:
    """The traced value of a get_attr weight with `dims` dims, else None."""
    value = node.meta.get("val") if isinstance(node, fx.Node) and node.op == "get_attr" else None
    return value if isinstance(value, torch.Tensor) and value.dim() == dims else None


def _through_views(node):
    while is_op(node, *_VIEWS):
        node = node.args[0]
    return node


def _through_casts(node):
    while is_op(node, aten.to.dtype, aten._to_copy.default):
        node = node.args[0]
    return node


def _gated(act) -> fx.Node | None:
    """`up * silu(gate)` (either order) of `chunk(y, 2, -1)` -> y."""
    if not is_op(act, aten.mul.Tensor) or len(act.args) != 2:
        return None
    silu = next((a for a in act.args if is_op(a, aten.silu.default)), None)
    up = act.args[0] if act.args[1] is silu else act.args[1]
    if silu is None or not (is_op(silu.args[0], operator.getitem) and is_op(up, operator.getitem)):
        return None
    gate = silu.args[0]
    chunk = gate.args[0]
    if up.args[0] is not chunk or (gate.args[1], up.args[1]) != (0, 1):
        return None
    if not (is_op(chunk, aten.chunk.default) and chunk.args[1] == 2 and chunk.args[2] in (-1, 2)):
        return None
    return chunk.args[0]


def _upstream(node: fx.Node, depth: int) -> list[fx.Node]:
    """The node and its inputs up to `depth` steps back, each once, nearest first."""
    found, frontier = {node: None}, [node]  # a dict: insertion order, each node once
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in found]
        found.update(dict.fromkeys(frontier))
    return list(found)


def _topk_indices(scores: fx.Node, depth: int = 8) -> fx.Node | None:
    """The `topk(...)[1]` the dense scores were scattered from (searched upstream), else None."""
    for scatter in _upstream(scores, depth):
        index = scatter.args[2] if is_op(scatter, aten.scatter_.src, aten.scatter.src) else None
        if is_op(index, operator.getitem) and index.args[1] == 1 and is_op(index.args[0], aten.topk.default):
            return index
    return None


def _is_grouped_mm(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and "grouped_mm" in str(node.target)


def _grouped_weight(node) -> fx.Node | None:
    """`grouped(x, transpose(W, -2, -1), offsets)` -> W (a 3-D get_attr), else None."""
    if not _is_grouped_mm(node):
        return None
    transposed = node.args[1]
    if not (is_op(transposed, aten.transpose.int) and set(transposed.args[1:]) in ({-2, -1}, {1, 2})):
        return None
    return transposed.args[0] if _param(transposed.args[0], 3) is not None else None


def _match_grouped(total: fx.Node):
    """sum([1]) of transformers' grouped experts -> (x, top_k_index, top_k_weights, W_gu, W_d),
    else None (not this form) or a reason string."""
    if not (is_op(total, aten.sum.dim_IntList) and list(total.args[1]) == [1]):
        return None
    unsorted = _through_views(total.args[0])
    if not is_op(unsorted, aten.index.Tensor):
        return None
    weighted = unsorted.args[0]
    if not is_op(weighted, aten.mul.Tensor):
        return "the per-token sum is not of weighted expert outputs"
    down_out = next((a for a in weighted.args if _is_grouped_mm(a)), None)
    scale = weighted.args[0] if weighted.args[1] is down_out else weighted.args[1]
    w_down = _grouped_weight(down_out)
    if w_down is None:
        return "the weighted outputs are not a grouped GEMM of 3-D expert weights"
    gate_up_out = _gated(_through_casts(down_out.args[0]))
    w_gate_up = _grouped_weight(gate_up_out)
    if w_gate_up is None:
        return "the down projection's input is not silu(gate) * up of a grouped GEMM"
    sorted_weights = _through_views(scale.args[0]) if is_op(scale, aten.unsqueeze.default) else None
    if not is_op(sorted_weights, aten.index.Tensor):
        return "the routing weights are not the sorted top-k weights"
    tokens = _through_casts(gate_up_out.args[0])
    if not is_op(tokens, aten.index.Tensor):
        return "the experts' input is not the tokens gathered in expert order"
    perm = sorted_weights.args[1][0]
    if not (is_op(perm, operator.getitem) and perm.args[1] == 1 and is_op(perm.args[0], aten.sort.default)):
        return "the expert order is not a sort of the expert ids"
    top_k_index = _through_views(perm.args[0].args[0])
    top_k_weights = _through_views(sorted_weights.args[0])
    return tokens.args[0], top_k_index, top_k_weights, w_gate_up, w_down


def _match_llama4(total: fx.Node):
    """sum([0]) of the Llama-4 experts -> (x, scores, indices, W_gu, W_d), else a reason string."""
    if not (is_op(total, aten.sum.dim_IntList) and list(total.args[1]) == [0]):
        return None
    down_bmm = _through_views(total.args[0])
    if not is_op(down_bmm, aten.bmm.default):
        return "the sum over experts is not of a bmm"
    act, w_down = down_bmm.args
    down = _param(w_down, 3)
    gate_up_bmm = _gated(act)
    if down is None or not is_op(gate_up_bmm, aten.bmm.default):
        return "the expert bmm's input is not up * silu(gate) of a bmm with 3-D expert weights"
    routed_in, w_gate_up = gate_up_bmm.args
    gate_up = _param(w_gate_up, 3)
    routed_in = _through_views(routed_in)
    if gate_up is None or not is_op(routed_in, aten.mul.Tensor):
        return "the experts' input is not the tokens times their routing weights"
    repeat = next((a for a in routed_in.args if is_op(a, aten.repeat.default)), None)
    scale = routed_in.args[0] if routed_in.args[1] is repeat else routed_in.args[1]
    transposed_scores = _through_views(scale)
    if repeat is None or not is_op(transposed_scores, aten.transpose.int):
        return "the experts' input is not repeat(x) * transpose(scores)"
    experts = gate_up.shape[0]
    if list(repeat.args[1]) != [experts, 1]:
        return f"repeat {list(repeat.args[1])} is not once per expert ({experts})"
    scores = transposed_scores.args[0]
    indices = _topk_indices(scores)
    if indices is None:
        return "no topk found upstream of the routing scores"
    return repeat.args[0], scores, indices, w_gate_up, w_down


@register
class MatchMoE(Transform):
    name = "match_moe"
    # fuse_silu_and_mul would take the experts' silu * up out of the form matched here
    before = ("fuse_silu_and_mul",)

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for total in list(gm.graph.nodes):
            llama4, grouped = _match_llama4(total), _match_grouped(total)
            if isinstance(llama4, tuple):
                x, scores, indices, w_gate_up, w_down = llama4
                with gm.graph.inserting_before(total):
                    # the k routing weights of each token: [T, k], the model's own sigmoid values
                    weights = gm.graph.call_function(aten.gather.default, (scores, 1, indices))
                    weights.meta["val"] = fake_value(torch.gather, scores, 1, indices)
                    moe = gm.graph.call_function(MOE, (x, indices, weights, w_gate_up, w_down, True, True))
            elif isinstance(grouped, tuple):
                x, indices, weights, w_gate_up, w_down = grouped
                with gm.graph.inserting_before(total):
                    moe = gm.graph.call_function(MOE, (x, indices, weights, w_gate_up, w_down, False, False))
            else:
                continue
            replace(total, moe)
            moe.meta["val"] = fake_value(lambda v, *_: torch.empty_like(v), x)
            matches += 1
        if matches:
            _drop_unread_inverse_permutations(gm)
        return matches

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        """Every sum over experts' outputs left as it was, with where its form stopped."""
        return [
            f"{node.name}: {reason}"
            for node in gm.graph.nodes
            for reason in (_match_llama4(node), _match_grouped(node))
            if isinstance(reason, str) and _reads_expert_weights(node)
        ]


def _drop_unread_inverse_permutations(gm: fx.GraphModule) -> None:
    """The grouped form's `inv_perm[perm] = arange` (an in-place index_put_ into an empty_like)
    is no longer read once its experts are replaced, but dead-code elimination keeps in-place ops:
    erase it, so the sort and arange it reads go too."""
    drop_dead(gm)
    for node in list(gm.graph.nodes):
        target = node.args[0] if is_op(node, aten.index_put_.default) else None
        if not node.users and is_op(target, aten.empty_like.default) and len(target.users) == 1:
            gm.graph.erase_node(node)
            gm.graph.erase_node(target)


def _reads_expert_weights(node: fx.Node, depth: int = 12) -> bool:
    """Whether 3-D weights (stacked experts) feed the node within a few steps."""
    return any(_param(n, 3) is not None for n in _upstream(node, depth))

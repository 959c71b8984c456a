"""fuse_add_rmsnorm: a residual add and the RMSNorm reading it become one `pipeline::add_rms_norm`.

In a decoder the residual stream is `h = h + block(h)` followed by the next norm of h, and the sum
is read again by the next residual add; the fused op returns both (normed, sum), one kernel on CUDA
where there were two. Runs after match_rmsnorm. Matched only where the two addends have one shape
and dtype (no broadcasting) and every other reader of the sum comes after the norm, where the
fused node stands.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import aten, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, register

RMS_NORM = torch.ops.pipeline.rms_norm.default
ADD_RMS_NORM = torch.ops.pipeline.add_rms_norm.default


def _same_tensor_type(a, b) -> bool:
    values = [n.meta.get("val") if isinstance(n, fx.Node) else None for n in (a, b)]
    return all(isinstance(v, torch.Tensor) for v in values) and (
        values[0].shape == values[1].shape and values[0].dtype == values[1].dtype
    )


@register
class FuseAddRMSNorm(Transform):
    name = "fuse_add_rmsnorm"
    after = ("match_rmsnorm",)  # it fuses the add into pipeline::rms_norm

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        matches = 0
        for norm in list(gm.graph.nodes):
            if not is_op(norm, RMS_NORM):
                continue
            add = norm.args[0]
            if not (is_op(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs):
                continue
            x, residual = add.args
            if not _same_tensor_type(x, residual):
                continue
            if any(order.get(user, -1) < order[norm] for user in add.users if user is not norm):
                continue  # a reader before the norm (or one a rewrite just added): the sum is needed sooner
            weight, eps = norm.args[1], norm.args[2]
            with gm.graph.inserting_before(norm):
                fused = gm.graph.call_function(ADD_RMS_NORM, (x, residual, weight, eps))
                normed = gm.graph.call_function(operator.getitem, (fused, 0))
                total = gm.graph.call_function(operator.getitem, (fused, 1))
            fused.meta.update(norm.meta, val=(norm.meta.get("val"), add.meta.get("val")))
            replace(norm, normed)
            replace(add, total)
            matches += 1
        return matches

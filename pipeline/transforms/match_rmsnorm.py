"""match_rmsnorm: RMSNorm becomes `pipeline::rms_norm`, in graphs and (scope: model) in eager parts.

Graph form (HF's, computed in float32):
`[w *] cast(x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps))` with x32 = x or x.to(float32), the
cast `to.dtype` or `type_as`; Llama-4's QK-norm is the same without the weight.
Model scope: eager modules (outside the captured graphs) with a `weight` of the last dim and an
epsilon (`variance_epsilon` or `eps`) whose class name ends in RMSNorm are swapped for a module
that calls the canonical op, which is what the vision towers of the VLMs use.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import aten, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, eager_modules, register

RMS_NORM = torch.ops.pipeline.rms_norm.default
_CASTS = (aten.to.dtype, aten.type_as.default, aten._to_copy.default)


def _match(rsqrt: fx.Node):
    """rsqrt(mean(x32 ** 2) + eps) -> (x, normed node to replace, weight or None, eps)."""
    add = rsqrt.args[0]
    if not (is_op(add, aten.add.Tensor) and isinstance(add.args[1], float)):
        return None
    mean, eps = add.args
    if not (
        is_op(mean, aten.mean.dim)
        and list(mean.args[1]) in ([-1],)
        and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim"))
    ):
        return None
    square = mean.args[0]
    if not (is_op(square, aten.pow.Tensor_Scalar) and square.args[1] == 2):
        return None
    x32 = square.args[0]
    scaled = next((u for u in rsqrt.users if is_op(u, aten.mul.Tensor) and x32 in u.args), None)
    if scaled is None:
        return None
    x = x32.args[0] if is_op(x32, aten.to.dtype, aten._to_copy.default) else x32
    out = scaled
    if len(out.users) == 1 and is_op(next(iter(out.users)), *_CASTS):
        out = next(iter(out.users))
    weight = None
    if len(out.users) == 1:
        user = next(iter(out.users))
        if is_op(user, aten.mul.Tensor):
            other = user.args[0] if user.args[1] is out else user.args[1]
            if isinstance(other, fx.Node) and other.op == "get_attr":
                weight, out = other, user
    return x, out, weight, float(eps)


class CanonicalRMSNorm(nn.Module):
    """An eager RMSNorm module that calls the canonical op (same weight Parameter, no copy)."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMS_NORM(x, self.weight, self.eps)


def _eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        if isinstance(getattr(module, attr, None), float):
            return getattr(module, attr)
    return None


@register
class MatchRMSNorm(Transform):
    name = "match_rmsnorm"
    scopes = ("subgraph", "model")

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            if not (is_op(node, aten.rsqrt.default) and (found := _match(node))):
                continue
            x, out, weight, eps = found
            with gm.graph.inserting_before(out):
                canonical = gm.graph.call_function(RMS_NORM, (x, weight, eps))
            replace(out, canonical)
            matches += 1
        return matches

    def apply_model(self, model: nn.Module, ctx: TransformContext) -> int:
        swaps = []
        for path, module in eager_modules(model):
            weight, eps = getattr(module, "weight", None), _eps(module)
            if (
                path
                and type(module).__name__.endswith("RMSNorm")
                and isinstance(weight, nn.Parameter)
                and eps is not None
            ):
                swaps.append((path, CanonicalRMSNorm(weight, eps)))
        for path, replacement in swaps:
            model.set_submodule(path, replacement)
        return len(swaps)

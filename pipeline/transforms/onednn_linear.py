"""onednn_linear: linears on CPU run through oneDNN's inner product instead of F.linear.

Why: on this CPU build F.linear goes to MKL's GEMM with the weight transposed, which at decode
sizes reads a [N, K] weight at about a third of the machine's memory bandwidth (measured: a
[32000, 512] float32 weight at batch 1 takes 4.3 ms in F.linear and 1.5 ms in oneDNN; at batch 4
7.5 ms vs 1.7 ms; prefill GEMMs run about 2x faster too). The weight stays the same Parameter:
oneDNN reads the plain [N, K] layout, so nothing is copied, repacked or counted twice.

Scope subgraph: every `aten.linear` in a captured graph. Scope model: the eager `nn.Linear` modules
outside the graphs (lm_head of a VLM, the vision tower's projections), which are swapped for
`OneDNNLinear` holding the same Parameters. The default runs both. Only float32 weights on CPU: elsewhere
F.linear already runs the better kernel (see `_supported`).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from pipeline import ops  # noqa: F401  (registers pipeline::onednn_linear)
from pipeline.transforms.graph import aten, finish, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, eager_modules, register

ONEDNN_LINEAR = torch.ops.pipeline.onednn_linear.default


def _supported(weight: torch.Tensor | None) -> bool:
    """float32 weights on CPU. bfloat16's F.linear already runs oneDNN (its matmul primitive), and
    measured a little faster than the inner product at decode sizes (mistral3's lm_head at batch 4:
    40.8 vs 44.2 ms), so bfloat16 is left alone."""
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
    )


def _weight_of(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The linear's weight: the tensor itself for a get_attr, else its traced (fake) value."""
    weight = node.args[1]
    if not isinstance(weight, fx.Node):
        return None
    if weight.op != "get_attr":
        return weight.meta.get("val")
    value = gm
    for part in weight.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


class OneDNNLinear(nn.Module):
    """An eager nn.Linear's Parameters, computed by pipeline::onednn_linear."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [N, K], the same Parameter
        self.bias = linear.bias  # [N] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ONEDNN_LINEAR(x, self.weight, self.bias)


@register
class OneDNNLinearTransform(Transform):
    name = "onednn_linear"
    scopes = ("subgraph", "model")

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        if not torch.backends.mkldnn.is_available():
            return 0
        matches = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, aten.linear.default):
                continue
            x, weight = node.args[0], _weight_of(gm, node)
            if not _supported(weight) or getattr(x.meta.get("val"), "dtype", None) != weight.dtype:
                continue  # mixed dtypes: F.linear's promotion rules, not oneDNN's
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            with gm.graph.inserting_before(node):
                onednn = gm.graph.call_function(ONEDNN_LINEAR, (x, node.args[1], bias))
            replace(node, onednn)
            gm.graph.erase_node(node)
            matches += 1
        finish(gm)
        return matches

    def apply_model(self, model: nn.Module, ctx: TransformContext) -> int:
        if not torch.backends.mkldnn.is_available():
            return 0
        swaps = [
            path
            for path, module in eager_modules(model)
            if path and type(module) is nn.Linear and _supported(module.weight)
        ]
        for path in swaps:
            model.set_submodule(path, OneDNNLinear(model.get_submodule(path)))
        return len(swaps)

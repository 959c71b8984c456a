"""What the transforms that route linears to another kernel share (onednn_linear, bf16_gemv):
find each `aten.linear` of a captured graph whose weight the kernel takes and call the kernel's op
in its place (scope subgraph), or swap the eager `nn.Linear` modules outside the graphs for
`OpLinear` on the same Parameters (scope model: a VLM's lm_head, its vision tower). The weight
stays the same Parameter in its [N, K] layout: nothing is copied, repacked or counted twice."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import fx, nn

from pipeline.transforms.graph import aten, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, eager_modules


def weight_of(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """A linear node's weight: the tensor itself for a get_attr, else its traced (fake) value."""
    weight = node.args[1]
    if not isinstance(weight, fx.Node):
        return None
    if weight.op != "get_attr":
        return weight.meta.get("val")
    value = gm
    for part in weight.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


class OpLinear(nn.Module):
    """An eager nn.Linear's Parameters, computed by a `pipeline::` linear op (x, weight, bias);
    each route subclasses it with its op, so the profile's module names say which kernel ran."""

    op: ClassVar[torch._ops.OpOverload]

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [N, K], the same Parameter
        self.bias = linear.bias  # [N] or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)


class LinearRoute(Transform):
    """Subclasses set `module` (their OpLinear) and implement `takes(weight)` and `unavailable()`."""

    scopes = ("subgraph", "model")
    after = ("fuse_gemms",)  # a routed linear is no longer an aten.linear fuse_gemms can fuse
    module: ClassVar[type[OpLinear]]

    @staticmethod
    def takes(weight: torch.Tensor | None) -> bool:
        raise NotImplementedError

    @staticmethod
    def unavailable() -> str:
        """Why the kernel cannot run in this process ('' when it can): then nothing is rewritten."""
        raise NotImplementedError

    def candidates(self, gm: fx.GraphModule) -> list[fx.Node]:
        """The graph's linears whose weight the kernel takes, with an input of the weight's dtype
        (mixed dtypes follow F.linear's promotion rules, not the kernel's)."""
        return [
            node
            for node in gm.graph.nodes
            if is_op(node, aten.linear.default)
            and self.takes(weight := weight_of(gm, node))
            and getattr(node.args[0].meta.get("val"), "dtype", None) == weight.dtype
        ]

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        if self.unavailable():
            return 0
        matches = 0
        for node in self.candidates(gm):
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            with gm.graph.inserting_before(node):
                routed = gm.graph.call_function(self.module.op, (node.args[0], node.args[1], bias))
            replace(node, routed)
            gm.graph.erase_node(node)
            matches += 1
        return matches

    def apply_model(self, model: nn.Module, ctx: TransformContext) -> int:
        if self.unavailable():
            return 0
        swaps = [
            path
            for path, module in eager_modules(model)
            if path and type(module) is nn.Linear and self.takes(module.weight)
        ]
        for path in swaps:
            model.set_submodule(path, self.module(model.get_submodule(path)))
        return len(swaps)

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        """Linears the kernel would take, left as they are because it cannot run here, with why."""
        reason = self.unavailable()
        return [f"{node.name}: {reason}" for node in self.candidates(gm)] if reason else []

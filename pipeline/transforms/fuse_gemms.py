"""fuse_gemms: linears that read the same input become one GEMM with split outputs.

q/k/v projections and gate/up projections each read the same normalized hidden state; one GEMM with
concatenated weights reads that input once and launches once. Parameter count is unchanged: the
fused weight replaces the originals, which are deleted from the graph module and, where the eager
model still holds them, become views of the fused weight (no second copy).
x: [..., K]; weights W_i: [N_i, K] -> y = x @ cat(W_i)^T: [..., sum N_i] -> split along the last dim.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx

from pipeline.transforms.graph import (
    aten,
    common_module_stack,
    drop_dead,
    drop_parameters,
    fake_value,
    is_op,
    replace,
)
from pipeline.transforms.registry import Transform, TransformConfig, TransformContext, register


@dataclass
class FuseGemmsConfig(TransformConfig):
    min_group: int = 2  # fuse groups of at least this many linears


def _param(gm: fx.GraphModule, node: fx.Node, index: int) -> torch.Tensor | None:
    arg = node.args[index] if len(node.args) > index else None
    return gm.get_parameter(arg.target) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None


def _share(originals: list[torch.Tensor], fused: torch.Tensor) -> None:
    """The originals become row views of the fused tensor, their own memory freed: the eager
    modules the graph replaced still hold them (the profiler's eager reference and the bench swap
    those back), and two copies of every projection weight did not fit beside a 2.9 B float32
    model on this 24 GiB machine."""
    offset = 0
    for tensor in originals:
        rows = tensor.shape[0]
        tensor.data = fused.data[offset : offset + rows]  # [N_i, K], the same values
        offset += rows


@register
class FuseGemms(Transform):
    name = "fuse_gemms"
    Config = FuseGemmsConfig

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        # Linears with parameter weights (and biases, as Qwen's q/k/v have), grouped by input and
        # by whether they have a bias: both kinds can read the same input.
        groups: dict[tuple[fx.Node, bool], list[fx.Node]] = defaultdict(list)
        for node in gm.graph.nodes:
            if not (is_op(node, aten.linear.default) and _param(gm, node, 1) is not None):
                continue
            has_bias = len(node.args) > 2 and node.args[2] is not None
            if has_bias and _param(gm, node, 2) is None:
                continue
            groups[(node.args[0], has_bias)].append(node)
        matches, replaced = 0, []
        for (x, has_bias), linears in groups.items():
            weights = [_param(gm, n, 1) for n in linears]
            if len(linears) < self.config.min_group or len({(w.dtype, w.shape[1]) for w in weights}) != 1:
                continue
            biases = [_param(gm, n, 2) for n in linears] if has_bias else None
            replaced += [n.args[i].target for n in linears for i in ((1, 2) if has_bias else (1,))]
            self._fuse(gm, x, linears, weights, biases)
            matches += 1
        drop_dead(gm)  # the replaced linears' reads of their weights go first
        drop_parameters(gm, replaced)
        return matches

    @staticmethod
    def _fuse(
        gm: fx.GraphModule,
        x: fx.Node,
        linears: list[fx.Node],
        weights: list[torch.Tensor],
        biases: list[torch.Tensor] | None,
    ) -> None:
        first_target = linears[0].args[1].target  # e.g. layers.0.self_attn.q_proj.weight
        owner = first_target.rsplit(".", 2)[0] if first_target.count(".") >= 2 else ""
        leaves = [n.args[1].target.rsplit(".", 2)[-2] for n in linears]
        prefix = "fused_" + "_".join(leaves)
        owner_module = gm.get_submodule(owner)
        with torch.no_grad():
            fused = torch.nn.Parameter(torch.cat(weights, dim=0), requires_grad=False)  # [sum N_i, K]
            owner_module.register_parameter(f"{prefix}_weight", fused)
            _share(weights, fused)
            if biases is not None:
                fused_bias = torch.nn.Parameter(torch.cat(biases, dim=0), requires_grad=False)  # [sum N_i]
                owner_module.register_parameter(f"{prefix}_bias", fused_bias)
                _share(biases, fused_bias)
        sizes = [int(w.shape[0]) for w in weights]
        anchor = min(linears, key=lambda n: list(gm.graph.nodes).index(n))
        stack = common_module_stack(linears)
        qualified = f"{owner}.{prefix}" if owner else prefix
        with gm.graph.inserting_before(anchor):
            args = [x, gm.graph.get_attr(f"{qualified}_weight")]
            if biases is not None:
                args.append(gm.graph.get_attr(f"{qualified}_bias"))
            gemm = gm.graph.call_function(aten.linear.default, tuple(args))
            split = gm.graph.call_function(aten.split_with_sizes.default, (gemm, sizes, -1))
            parts = [gm.graph.call_function(operator.getitem, (split, i)) for i in range(len(linears))]
        gemm.meta["nn_module_stack"] = stack
        split.meta["nn_module_stack"] = stack
        # The fused output is the parts side by side. (Running aten.linear on the fake input
        # decomposes to matmul, which calls numel() on symbolic sizes under torch 2.11.)
        value = fake_value(lambda *outs: torch.cat(outs, dim=-1), *linears)  # [..., sum N_i]
        if value is not None:
            gemm.meta["val"] = value
        for linear, part in zip(linears, parts, strict=True):
            replace(linear, part)
            gm.graph.erase_node(linear)

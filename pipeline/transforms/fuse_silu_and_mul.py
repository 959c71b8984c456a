"""fuse_silu_and_mul: the gated MLP's `silu(gate) * up` on two halves of one GEMM's output becomes
one `pipeline::silu_and_mul` of those halves.

After fuse_gemms the MLP reads `split(gate_up, [I, I], -1)` (Llama-4's shared expert: the router's
columns first, `[E, I, I]`; its experts: `chunk(2, -1)` of a bmm, and `up * silu(gate)`), then
silu of the gate times the up: two elementwise kernels and two [..., I] intermediates, where one
kernel reads [..., 2I] and writes [..., I]. Where gate and up are not the whole split input, the op
reads a last-dim slice of it (a view). Runs after fuse_gemms; without it the halves come from two
GEMMs and nothing matches.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import aten, fake_value, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, register

SILU_AND_MUL = torch.ops.pipeline.silu_and_mul.default


def _piece_sizes(split: fx.Node, width: int) -> list[int] | None:
    """Last-dim sizes of a split_with_sizes / split / chunk's pieces, or None for another node."""
    if is_op(split, aten.split_with_sizes.default):
        return list(split.args[1])
    if is_op(split, aten.split.Tensor):
        size = split.args[1]
        return [min(size, width - start) for start in range(0, width, size)]
    if is_op(split, aten.chunk.default):
        size = math.ceil(width / split.args[1])
        return [min(size, width - start) for start in range(0, width, size)]
    return None


def _gate_up(gate: fx.Node, up: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(the split input, start, end) when gate and up are consecutive equal pieces of one split on
    the last dim, each read once; None otherwise."""
    if not (is_op(gate, operator.getitem) and is_op(up, operator.getitem)):
        return None
    split = gate.args[0]
    if up.args[0] is not split or up.args[1] != gate.args[1] + 1:
        return None
    if len(gate.users) != 1 or len(up.users) != 1 or not isinstance(split.args[0], fx.Node):
        return None
    value = split.args[0].meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in (-1, value.dim() - 1):
        return None
    sizes = _piece_sizes(split, value.shape[-1])
    index = gate.args[1]
    if sizes is None or sizes[index] != sizes[index + 1]:
        return None
    start = sum(sizes[:index])
    return split.args[0], start, start + 2 * sizes[index]


@register
class FuseSiluAndMul(Transform):
    name = "fuse_silu_and_mul"
    after = ("fuse_gemms",)  # gate and up as two halves of one GEMM's output

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for mul in list(gm.graph.nodes):
            if not (is_op(mul, aten.mul.Tensor) and len(mul.args) == 2 and not mul.kwargs):
                continue
            silu = next((a for a in mul.args if is_op(a, aten.silu.default)), None)
            if silu is None or len(silu.users) != 1:
                continue
            found = _gate_up(silu.args[0], mul.args[1] if mul.args[0] is silu else mul.args[0])
            if found is None:
                continue
            source, start, end = found
            with gm.graph.inserting_before(mul):
                gate_up = source
                if (start, end) != (0, source.meta["val"].shape[-1]):  # [..., 2I] of a wider output
                    gate_up = gm.graph.call_function(aten.slice.Tensor, (source, -1, start, end))
                    gate_up.meta.update(
                        source.meta, val=fake_value(aten.slice.Tensor, source, -1, start, end)
                    )
                fused = gm.graph.call_function(SILU_AND_MUL, (gate_up,))
            replace(mul, fused)
            matches += 1
        return matches

"""cleanup: drop what export leaves in the way of pattern matching.

- `_assert_tensor_metadata` / `_assert_scalar` nodes: export's own dtype/device asserts, which sit
  between producers and consumers and pin values the rewrites need to replace;
- full-range slices `x[:, 0:INT64_MAX]`, `x + 0`, float `x * 1.0`, casts to the dtype x already
  has, and views/expands to the shape x already has (static shapes only).
"""

from __future__ import annotations

from torch import fx

from pipeline.transforms.graph import INT64_MAX, aten, is_op
from pipeline.transforms.registry import Transform, TransformContext, register

_ASSERTS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default)


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _static_shape(value) -> tuple[int, ...] | None:
    if value is None or not hasattr(value, "shape"):
        return None
    shape = tuple(value.shape)
    return shape if all(isinstance(d, int) for d in shape) else None


def _is_noop(node: fx.Node) -> bool:
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node):
        return False
    out, inp = _val(node), _val(src)
    same_dtype = (
        out is not None and inp is not None and getattr(out, "dtype", None) == getattr(inp, "dtype", None)
    )
    if is_op(node, aten.slice.Tensor):
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else INT64_MAX
        step = node.args[4] if len(node.args) > 4 else 1
        return start == 0 and end == INT64_MAX and step == 1
    if is_op(node, aten.add.Tensor) and len(node.args) == 2 and node.args[1] == 0:
        return same_dtype
    if is_op(node, aten.mul.Tensor) and len(node.args) == 2 and node.args[1] == 1.0:
        return same_dtype and inp.dtype.is_floating_point
    if is_op(node, aten.to.dtype):
        return same_dtype
    if is_op(node, aten.view.default, aten.reshape.default, aten.expand.default):
        shape_in, shape_out = _static_shape(inp), _static_shape(out)
        return shape_in is not None and shape_in == shape_out
    return False


@register
class Cleanup(Transform):
    name = "cleanup"
    decoding = True
    # the matchers are written against the graph without export's asserts and no-op ops
    before = ("match_attention", "match_rope", "match_rmsnorm", "match_moe")

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            if is_op(node, *_ASSERTS):
                gm.graph.erase_node(node)
                matches += 1
            elif node.op == "call_function" and _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                matches += 1
        return matches

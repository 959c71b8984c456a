"""match_rope: rotary embeddings become `pipeline::rope` (rotate-half) or `pipeline::rope_complex`.

Rotate-half (Mistral, Llama 3 with llama3 scaling, Qwen2.5-VL's multimodal RoPE: only cos/sin
differ): `x * cos + cat([-x[..., h:], x[..., :h]], -1) * sin`, one match per rotated tensor.
Complex (Llama-4): `view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs).flatten(3)`,
followed by a cast back to x's dtype.
"""

from __future__ import annotations

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers the canonical ops used below)
from pipeline.transforms.graph import INT64_MAX, aten, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, register

ROPE = torch.ops.pipeline.rope.default
ROPE_COMPLEX = torch.ops.pipeline.rope_complex.default


def _slice_of(node, x: fx.Node) -> tuple[int, int] | None:
    """(start, end) when node is x[..., start:end] on the last dim."""
    if not (is_op(node, aten.slice.Tensor) and node.args[0] is x):
        return None
    dim = node.args[1]
    rank = len(x.meta["val"].shape) if "val" in x.meta else None
    if dim != -1 and dim != (rank - 1 if rank else None):
        return None
    return node.args[2], node.args[3] if len(node.args) > 3 else INT64_MAX


def _rotate_half_of(node) -> fx.Node | None:
    """x when node = cat([-x[..., h:], x[..., :h]], -1)."""
    if not is_op(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    neg, low = node.args[0]
    if not is_op(neg, aten.neg.default):
        return None
    high = neg.args[0]
    x = high.args[0] if is_op(high, aten.slice.Tensor) else None
    if x is None or _slice_of(low, x) is None or _slice_of(high, x) is None:
        return None
    (lo_start, lo_end), (hi_start, _) = _slice_of(low, x), _slice_of(high, x)
    return x if lo_start == 0 and lo_end == hi_start else None


def _match_rotate_half(add: fx.Node):
    for a, b in (add.args, add.args[::-1]):
        if is_op(a, aten.mul.Tensor) and is_op(b, aten.mul.Tensor):
            for x, cos in (a.args, a.args[::-1]):
                for rot, sin in (b.args, b.args[::-1]):
                    if isinstance(x, fx.Node) and _rotate_half_of(rot) is x:
                        return x, cos, sin
    return None


def _match_complex(flatten: fx.Node):
    """flatten(view_as_real(view_as_complex(reshape(x)) * freqs), 3) -> (x, freqs)."""
    real = flatten.args[0]
    if not is_op(real, aten.view_as_real.default):
        return None
    mul = real.args[0]
    if not is_op(mul, aten.mul.Tensor):
        return None
    for pairs, freqs in (mul.args, mul.args[::-1]):
        if is_op(pairs, aten.view_as_complex.default) and is_op(
            pairs.args[0], aten.reshape.default, aten.view.default
        ):
            return pairs.args[0].args[0], freqs
    return None


@register
class MatchRope(Transform):
    name = "match_rope"

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            if is_op(node, aten.add.Tensor) and (found := _match_rotate_half(node)):
                anchor, target, args = node, ROPE, found
            elif is_op(node, aten.flatten.using_ints) and (found := _match_complex(node)):
                x, freqs = found
                # The cast back to x's dtype is part of the op; fold it in when it is there.
                cast = next(iter(node.users)) if len(node.users) == 1 else None
                folds = cast is not None and is_op(cast, aten.type_as.default) and cast.args[1] is x
                anchor, target, args = (cast if folds else node), ROPE_COMPLEX, (x, freqs)
            else:
                continue
            with gm.graph.inserting_before(anchor):
                canonical = gm.graph.call_function(target, tuple(args))
            replace(anchor, canonical)
            matches += 1
        return matches

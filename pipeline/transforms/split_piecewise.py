"""split_piecewise: where piecewise capture cuts a cached graph (backend.piecewise=true).

Each node gets the index of its segment (node meta `graphs.SEGMENT`) and the graph's record the
list of segments: `layout` segments hold the ops whose work depends on the step's sequence layout
(`attention.LAYOUT_OPS`: the attention plan and each layer's cached attention), run eagerly between
the others; `static` segments hold everything between them, captured or compiled per token
bucket; a `head` segment holds the logits (the first node after the last layout op that reads a
vocabulary-sized weight, and all after it), captured only with backend.piecewise_capture_lm_head.
The graph itself is not restructured: numerics, the profiler's ranges and the eager reference keep
reading one flat graph, and the backend builds the segments from the marks (backends/piecewise.py).

Segments follow node order, so each reads only graph inputs and earlier segments' values, and a
layout op's multiple outputs (getitem) stay with it. Consecutive layout ops share a segment.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from pipeline.attention import LAYOUT_OPS
from pipeline.graphs import SEGMENT, Segment, module_paths, record_of
from pipeline.transforms.registry import Transform, TransformContext


def is_layout_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.name in LAYOUT_OPS


def _reads_vocabulary_weight(node: fx.Node, gm: fx.GraphModule, vocab_size: int) -> bool:
    """The lm_head's GEMM (weight [V, H]), whatever op the transforms made of it."""
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = operator.attrgetter(arg.target)(gm)
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == vocab_size:
                return True
    return False


def _innermost_module(node: fx.Node) -> str | None:
    paths = module_paths(node)
    return paths[-1] if paths else None


def mark_segments(gm: fx.GraphModule, vocab_size: int | None) -> list[Segment]:
    """Mark each computing node with its segment index; the segments in order."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    last_layout = max((i for i, n in enumerate(nodes) if is_layout_op(n)), default=-1)
    segments: list[Segment] = []
    for i, node in enumerate(nodes):
        source = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(source, fx.Node) and SEGMENT in source.meta and is_layout_op(source):
            kind = "layout"  # a layout op's output stays with it
        elif is_layout_op(node):
            kind = "layout"
        elif segments and segments[-1].kind == "head":
            kind = "head"
        elif i > last_layout >= 0 and vocab_size and _reads_vocabulary_weight(node, gm, vocab_size):
            kind = "head"
        else:
            kind = "static"
        if not segments or segments[-1].kind != kind:
            segments.append(Segment(len(segments), kind, []))
        segment = segments[-1]
        segment.nodes.append(node.name)
        node.meta[SEGMENT] = segment.index
        module = _innermost_module(node)
        if module and module not in segment.modules[-1:]:
            segment.modules.append(module)
    for segment in segments:  # first and last module are what a reader needs
        segment.modules = (
            segment.modules[:1] + segment.modules[-1:] if len(segment.modules) > 1 else segment.modules
        )
    return segments


class SplitPiecewise(Transform):
    """Run by the transforms stage after the configured ones when backend.piecewise=true; not in the
    registry, since the backend asks for it, not a transforms.* entry. Matches: the segments that
    run eagerly."""

    name = "split_piecewise"
    after = ("insert_cached_attention",)

    def __init__(self, config=None):
        super().__init__(config or self.Config())
        self.segments: list[Segment] = []

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        record = record_of(gm)
        if not record.has_cache:
            self.segments = []
            return 0
        text = record.text_config
        self.segments = record.segments = mark_segments(gm, getattr(text, "vocab_size", None))
        return sum(s.kind == "layout" for s in self.segments)

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        if self.segments:
            return []
        return [
            "the graph has no cached attention (insert_cached_attention matched nothing): nothing to split at"
        ]

    def matched(self) -> list[str]:
        return [segment.describe() for segment in self.segments]

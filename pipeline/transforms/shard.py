"""shard: tensor parallelism on the exported graph, found as TensorRT-LLM's AutoDeploy finds it.

A region is the linears that read one input (q/k/v of an attention; gate/up of an MLP), the head-
or element-wise ops after them, and the one linear that reads their result (o; down). The opening
linears split their output rows (column-parallel: each rank computes H/N heads, KV heads with them,
or I/N of the intermediate), the closing linear its input columns (row-parallel: each rank a partial
sum over its heads), followed by an all-reduce of the partial sums and the closing bias, once.
Rank r holds q heads [rH/N, (r+1)H/N) and KV heads [rHkv/N, (r+1)Hkv/N): GQA's contiguous groups
keep every q head with its KV head. A region whose ops could mix heads (a reduction over the
hidden size, an expand, anything not on the list below), or whose values escape it (Llama-4's MoE
adds the router's experts beside its shared expert), stays replicated and is listed, with why, in
the transform's record.

The all-reduce is torch's functional collective (`_c10d_functional.all_reduce` + `wait_tensor`),
which Inductor lowers and CUDA graphs capture, over the run's process group (gloo on CPU, NCCL on
GPU). source: heuristic finds the regions from the graph; tp_plan keeps only regions the model's
Hugging Face `base_model_tp_plan` marks (opening colwise, closing rowwise).

Runs after match_attention (heads are explicit in pipeline::attention, the repeat_kv expand gone)
and before fuse_gemms (which then fuses the shards as it fused the whole weights).
x: [T, K]; opening W_i: [N_i, K] -> [N_i/ws, K]; closing W: [M, N] -> [M, N/ws]; y = all_reduce(.)

Scope model: the eager lm_head, vocab-parallel (lm_head=vocab_parallel, the default): each rank
reads V/N of its rows and an all-gather of the logits gives every rank the whole vocabulary. A
decode step reads the lm_head whole otherwise (mistral3: 1.34 GB of a rank's 2.45 GB in bfloat16);
the all-gather of one step's logits took 0.46 ms against 135 ms steps (BENCHMARKS.md, tensor
parallelism). The embedding stays whole: a step reads B of its rows.
"""

from __future__ import annotations

import operator
import re
from collections import deque
from dataclasses import dataclass
from enum import Enum

import torch
from torch import fx, nn
from torch.fx.node import map_arg

from pipeline import ops  # noqa: F401  (registers the canonical ops named below)
from pipeline.models.deferred import DeferredWeights
from pipeline.transforms.graph import aten, drop_dead, is_op
from pipeline.transforms.registry import Transform, TransformConfig, TransformContext, eager_modules, register

ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
ATTENTION = torch.ops.pipeline.attention.default
pipeline_ops = torch.ops.pipeline

# Ops that act on each head (or each element) alone, so they compute on a rank's heads what they
# computed on all: shape changes, casts, element-wise math, the canonical attention and rope.
HEADWISE = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.contiguous.default, aten.clone.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.neg.default, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.div.Tensor, aten.silu.default, aten.gelu.default, aten.tanh.default, aten.sigmoid.default,
    aten.relu.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.to.dtype, aten._to_copy.default,
    aten.type_as.default, aten.alias.default, operator.getitem,
    pipeline_ops.attention.default, pipeline_ops.rope.default, pipeline_ops.rope_complex.default,
    pipeline_ops.silu_and_mul.default,
}  # fmt: skip
# Ops over the last dim: head-wise only on [B, H, S, D] or [B, S, H, D] values (q_norm, rotate_half)
LAST_DIM = {aten.mean.dim, aten.slice.Tensor, aten.cat.default, pipeline_ops.rms_norm.default}
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class Source(Enum):
    """Where the column/row tuples come from: found in the graph, or the model's HF tp_plan."""

    heuristic = "heuristic"
    tp_plan = "tp_plan"


class LmHead(Enum):
    """The eager lm_head (scope model): its vocabulary split over the ranks, or whole on each."""

    vocab_parallel = "vocab_parallel"
    replicated = "replicated"


@dataclass
class ShardConfig(TransformConfig):
    source: Source = Source.heuristic  # an unknown value is a config error when the config is parsed
    lm_head: LmHead = LmHead.vocab_parallel


class VocabParallelLinear(nn.Module):
    """An lm_head split by vocabulary rows: rank r computes the logits of rows [rV/N, (r+1)V/N)
    and an all-gather gives every rank all V (sampling reads them whole). `local` is an nn.Linear,
    so onednn_linear and bf16_gemv still route it to their kernels."""

    def __init__(
        self,
        linear: nn.Linear,
        rank: int,
        world: int,
        group_name: str,
        weights: DeferredWeights | None = None,
    ):
        super().__init__()
        rows = linear.out_features // world
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.world, self.group_name = world, group_name
        self.local = nn.Linear(linear.in_features, rows, bias=linear.bias is not None, device="meta")
        self.local.weight = rank_part(linear.weight, 0, rank, world, weights)  # [V/N, K]
        if linear.bias is not None:
            self.local.bias = rank_part(linear.bias, 0, rank, world, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local(x)  # x: [B, S, K] -> [B, S, V/N]
        # all_gather_into_tensor stacks the ranks' tensors along dim 0: the vocabulary goes first
        gathered = WAIT(ALL_GATHER(local.movedim(-1, 0).contiguous(), self.world, self.group_name))
        return gathered.movedim(0, -1)  # [V, B, S] -> [B, S, V]


def rank_part(
    whole: torch.Tensor, dim: int, rank: int, world: int, weights: DeferredWeights | None
) -> nn.Parameter:
    """The rank's contiguous 1/world of a parameter along dim, a tensor of its own: cut from the
    whole, or, where load left a placeholder (runtime.tp_weights=shard), filled as that slice alone."""
    size = whole.shape[dim] // world
    if weights is not None and weights.recipe(whole) is not None:
        part = weights.slice(whole, dim, rank * size, size)
    else:
        part = whole.narrow(dim, rank * size, size).contiguous().clone()
    return nn.Parameter(part, requires_grad=False)


@dataclass
class Region:
    opening: list[fx.Node]  # linears reading one input: column-parallel
    closing: fx.Node  # the linear reading their result: row-parallel, then an all-reduce
    inner: list[fx.Node]  # the nodes between, in graph order
    head_dim: int | None  # of its attention, None for an MLP

    def describe(self) -> str:
        cols = ", ".join(_weight_name(n) for n in self.opening)
        return f"colwise [{cols}] -> rowwise {_weight_name(self.closing)} + all_reduce"


def is_linear(node) -> bool:
    return (
        is_op(node, aten.linear.default)
        and isinstance(node.args[1], fx.Node)
        and node.args[1].op == "get_attr"
    )


def _weight_name(linear: fx.Node) -> str:
    return str(linear.args[1].target)


def _ndim(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else None


def _headwise(node: fx.Node) -> str | None:
    """None if the node computes per head; else why it may not."""
    if node.op != "call_function":
        return f"{node.name} is a {node.op}"
    if node.target in HEADWISE:
        return None
    if node.target in LAST_DIM:
        # the values it reduces or joins (cat: a list of them; rms_norm: not its [D] weight)
        first = node.args[0]
        inputs = [
            a for a in (first if isinstance(first, list | tuple) else [first]) if isinstance(a, fx.Node)
        ]
        dim = node.args[1] if len(node.args) > 1 and node.target != pipeline_ops.rms_norm.default else -1
        dims = dim if isinstance(dim, list | tuple) else [dim]
        if inputs and all(_ndim(a) == 4 for a in inputs) and all(d in (-1, 3) for d in dims):
            return None
        return f"{node.name} ({node.target}) works over a dim that is not the head dim"
    return f"{node.name} ({node.target}) is not a head- or element-wise op"


def find_region(opening: list[fx.Node]) -> tuple[Region | None, str]:
    """The region the opening linears start: forward from their outputs to the next linear. (None,
    why) where it is not one: no single closing linear, values leaving it, an op that mixes heads."""
    seen: set[fx.Node] = set()
    closings: list[fx.Node] = []
    queue = deque(user for n in opening for user in n.users)
    while queue:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        if is_linear(node):
            closings.append(node)
            continue
        if node.op == "output":
            return None, f"{opening[0].name}'s result reaches the graph's output unreduced"
        if why := _headwise(node):
            return None, why
        queue.extend(node.users)
    if len(closings) != 1:
        names = ", ".join(c.name for c in closings) or "none"
        return None, f"{len(closings)} linears read {opening[0].name}'s region ({names}), not one"
    closing = closings[0]
    inner = seen - {closing}
    # Every inner node must feed the closing linear's input; one that does not leaves the region
    # with a rank's part of a value (Llama-4's router beside its shared expert).
    feeding, stack = set(), [closing.args[0]]
    while stack:
        node = stack.pop()
        if node in inner and node not in feeding:
            feeding.add(node)
            stack.extend(node.all_input_nodes)
    if escaped := inner - feeding:
        node = sorted(escaped, key=lambda n: n.name)[0]
        return None, f"{node.name} leaves {opening[0].name}'s region without passing {closing.name}"
    if closing.args[0] not in inner:
        return None, f"{closing.name} does not read the region's result"
    # An input from another linear would meet a rank's slice with a whole value.
    for node in inner:
        if outside := [a for a in node.all_input_nodes if is_linear(a) and a not in opening]:
            return None, f"{node.name} also reads {outside[0].name}, outside the region"
    attentions = [n for n in inner if is_op(n, ATTENTION)]
    head_dim = int(attentions[0].args[0].meta["val"].shape[-1]) if attentions else None
    order = {n: i for i, n in enumerate(closing.graph.nodes)}
    return Region(opening, closing, sorted(inner, key=order.__getitem__), head_dim), ""


def _plan_kind(plan: dict[str, str], weight: str) -> str | None:
    """The tp_plan entry ("colwise", "rowwise", ...) of a linear's weight, by its module path:
    the plan's keys are module patterns with * for a layer index."""
    module = weight.removesuffix(".weight")
    for pattern, kind in plan.items():
        regex = re.escape(pattern).replace(r"\*", r"[^.]+")
        if re.search(rf"(^|\.){regex}$", module):
            return kind
    return None


def tp_plan_of(hf_config) -> dict[str, str]:
    """The language model's Hugging Face tensor-parallel plan ({} when the model has none)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


@register
class Shard(Transform):
    name = "shard"
    decoding = True
    scopes = ("subgraph", "model")
    Config = ShardConfig
    # heads are explicit in pipeline::attention; the fusions and kernel routes then work on each
    # rank's shards, and the KV cache holds the rank's own KV heads
    after = ("match_attention",)
    before = ("fuse_gemms", "onednn_linear", "bf16_gemv", "insert_cached_attention")

    def __init__(self, config: ShardConfig):
        super().__init__(config)
        self._left: list[str] = []  # regions left replicated, each with why (the record's unmatched)
        self.sharded: list[str] = []  # the tuples split, for the record

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        self._left, self.sharded = [], []
        if ctx.world_size < 2:
            return 0
        plan = tp_plan_of(ctx.hf_config) if self.config.source is Source.tp_plan else None
        if plan is not None and not plan:
            raise ValueError("the model's config has no base_model_tp_plan: use source=heuristic")
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if is_linear(node):
                groups.setdefault(node.args[0], []).append(node)
        regions = []
        for opening in groups.values():
            if all(_is_lm_head(_weight_name(n)) for n in opening):
                continue  # vocab-parallel or replicated below, not a region
            region, why = find_region(opening)
            if region is None:
                self._left.append(f"[{', '.join(_weight_name(n) for n in opening)}]: {why}")
                continue
            if plan is not None:
                kinds = [_plan_kind(plan, _weight_name(n)) for n in opening]
                closing_kind = _plan_kind(plan, _weight_name(region.closing))
                if any(k != "colwise" for k in kinds) or closing_kind != "rowwise":
                    self._left.append(
                        f"{region.describe()}: the tp_plan says {kinds} -> {closing_kind}, not colwise -> rowwise"
                    )
                    continue
            if why := self._indivisible(gm, region, ctx.world_size):
                self._left.append(why)
                continue
            regions.append(region)
        for region in regions:
            self._shard(gm, region, ctx)
            self.sharded.append(region.describe())
        heads = [n for n in gm.graph.nodes if is_linear(n) and _is_lm_head(_weight_name(n))]
        if self.config.lm_head is LmHead.vocab_parallel:
            for head in heads:
                rows = gm.get_parameter(_weight_name(head)).shape[0]
                if rows % ctx.world_size:
                    self._left.append(
                        f"{_weight_name(head)}: {rows} rows do not divide by world_size {ctx.world_size}"
                    )
                    continue
                _vocab_parallel(gm, head, ctx)
                path = _weight_name(head).removesuffix(".weight")
                self.sharded.append(f"vocab-parallel {path} ({rows} rows) + all_gather")
        drop_dead(gm)  # the split weights' old reads go before the rest is filled
        if ctx.weights is not None:  # what no region split: whole
            ctx.weights.materialize_rest(gm)
        return len(self.sharded)

    def apply_model(self, model: nn.Module, ctx: TransformContext) -> int:
        """The eager lm_head (a captured language model's parent holds it), vocab-parallel; then any
        placeholder load left in the eager parts, filled whole."""
        self._left, self.sharded = [], []
        if ctx.world_size >= 2 and self.config.lm_head is LmHead.vocab_parallel:
            self._vocab_parallel_heads(model, ctx)
        if ctx.weights is not None:
            ctx.weights.materialize_rest(model)
        return len(self.sharded)

    def _vocab_parallel_heads(self, model: nn.Module, ctx: TransformContext) -> None:
        heads = [
            (path, module)
            for path, module in eager_modules(model)
            if _is_lm_head(f"{path}.weight") and type(module) is nn.Linear
        ]
        for path, head in heads:
            if head.out_features % ctx.world_size:
                self._left.append(
                    f"{path}: {head.out_features} rows do not divide by world_size {ctx.world_size}"
                )
                continue
            model.set_submodule(
                path, VocabParallelLinear(head, ctx.rank, ctx.world_size, ctx.group_name, ctx.weights)
            )
            self.sharded.append(f"vocab-parallel {path} ({head.out_features} rows) + all_gather")

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        return list(self._left)

    def unmatched_model(self) -> list[str]:
        return list(self._left)

    def matched(self) -> list[str]:
        return list(self.sharded)

    @staticmethod
    def _indivisible(gm: fx.GraphModule, region: Region, world: int) -> str | None:
        unit = region.head_dim or 1  # split whole heads
        for linear in region.opening:
            rows = gm.get_parameter(_weight_name(linear)).shape[0]
            if rows % (unit * world):
                what = f"{rows // unit} heads" if region.head_dim else f"{rows} rows"
                return f"{_weight_name(linear)}: {what} do not divide by world_size {world}"
        return None

    def _shard(self, gm: fx.GraphModule, region: Region, ctx: TransformContext) -> None:
        world = ctx.world_size
        for linear in region.opening:
            _slice_parameter(gm, linear.args[1], 0, ctx)
            if len(linear.args) > 2 and isinstance(linear.args[2], fx.Node):
                _slice_parameter(gm, linear.args[2], 0, ctx)
        closing = region.closing
        _slice_parameter(gm, closing.args[1], 1, ctx)
        # A reshape that named the head count ([B, S, H, D]) or the heads' width ([B, S, H*D]) in
        # dim 2 takes the rank's share: -1, or its 1/N beside another -1
        for node in region.inner:
            if is_op(node, *RESHAPES) and len(node.args[1]) >= 3 and isinstance(node.args[1][2], int):
                shape = list(node.args[1])
                shape[2] = shape[2] // world if -1 in shape else -1
                node.args = (node.args[0], shape)
        bias = closing.args[2] if len(closing.args) > 2 else None
        closing.args = (closing.args[0], closing.args[1])
        graph = gm.graph
        with graph.inserting_after(closing):
            reduced = graph.call_function(ALL_REDUCE, (closing, "sum", ctx.group_name))
        with graph.inserting_after(reduced):
            waited = graph.call_function(WAIT, (reduced,))
        result = waited
        if isinstance(bias, fx.Node):  # added once, after the sum of the partial products
            with graph.inserting_after(waited):
                result = graph.call_function(aten.add.Tensor, (waited, bias))
        closing.replace_all_uses_with(result, delete_user_cb=lambda user: user is not reduced)
        for node in (reduced, waited, result):
            node.meta["nn_module_stack"] = dict(closing.meta.get("nn_module_stack", {}))
        _propagate(
            [*region.opening, *region.inner, closing, reduced, waited]
            + ([result] if result is not waited else [])
        )


def _is_lm_head(weight_name: str) -> bool:
    """Hugging Face names every seed model's output projection `lm_head`."""
    return weight_name.removesuffix(".weight").rsplit(".", 1)[-1] == "lm_head"


def _vocab_parallel(gm: fx.GraphModule, head: fx.Node, ctx: TransformContext) -> None:
    """The graph's lm_head as VocabParallelLinear computes it: the rank's rows, then an all-gather
    of the logits with the vocabulary moved first (all_gather_into_tensor stacks along dim 0)."""
    _slice_parameter(gm, head.args[1], 0, ctx)
    if len(head.args) > 2 and isinstance(head.args[2], fx.Node):
        _slice_parameter(gm, head.args[2], 0, ctx)
    ndim = head.meta["val"].dim()
    graph = gm.graph
    with graph.inserting_after(head):  # [..., V/N] -> [V/N, ...]
        first = graph.call_function(aten.permute.default, (head, [ndim - 1, *range(ndim - 1)]))
    with graph.inserting_after(first):
        packed = graph.call_function(aten.clone.default, (first,), {"memory_format": torch.contiguous_format})
    with graph.inserting_after(packed):
        gathered = graph.call_function(ALL_GATHER, (packed, ctx.world_size, ctx.group_name))
    with graph.inserting_after(gathered):
        waited = graph.call_function(WAIT, (gathered,))
    with graph.inserting_after(waited):  # [V, ...] -> [..., V]
        logits = graph.call_function(aten.permute.default, (waited, [*range(1, ndim), 0]))
    head.replace_all_uses_with(logits, delete_user_cb=lambda user: user is not first)
    added = [first, packed, gathered, waited, logits]
    for node in added:
        node.meta["nn_module_stack"] = dict(head.meta.get("nn_module_stack", {}))
    _propagate([head, *added])


def _slice_parameter(gm: fx.GraphModule, get_attr: fx.Node, dim: int, ctx: TransformContext) -> None:
    """The graph's parameter replaced by the rank's part of it, a parameter of its own (the eager
    module that shared the whole one keeps it: the correctness reference)."""
    owner_path, _, leaf = str(get_attr.target).rpartition(".")
    owner = gm.get_submodule(owner_path)
    part = owner._parameters[leaf] = rank_part(
        owner._parameters[leaf], dim, ctx.rank, ctx.world_size, ctx.weights
    )
    value = get_attr.meta.get("val")
    if hasattr(value, "fake_mode"):
        get_attr.meta["val"] = value.fake_mode.from_tensor(part, static_shapes=True)


def _propagate(nodes: list[fx.Node]) -> None:
    """Recompute the shape metadata of the rewritten nodes, in graph order, on fake values: the
    later transforms (cached attention's KV heads) and the compiler read it."""
    values = [a.meta.get("val") for n in nodes for a in n.all_input_nodes]
    mode = next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)
    if mode is None:
        return
    with mode:
        for node in nodes:
            args = map_arg(node.args, lambda a: a.meta.get("val"))
            kwargs = map_arg(node.kwargs, lambda a: a.meta.get("val"))
            if node.target == aten.linear.default:
                # x: [..., K], W: [N, K] -> [..., N]; aten.linear on fake values decomposes to a
                # matmul that calls numel() on symbolic sizes (torch 2.11)
                x, weight = args[0], args[1]
                node.meta["val"] = x.new_empty((*x.shape[:-1], weight.shape[0]))
            else:
                node.meta["val"] = node.target(*args, **kwargs)

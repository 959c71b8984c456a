"""Piecewise capture (backend.piecewise=true): the steps a full-graph capture cannot replay.

A CUDA graph fixes every shape and address, so the decode runner (cudagraph.py) replays only
decode steps, whose shape follows the batch alone. Prefill and mixed steps vary in how their
tokens split into sequences, which only the layout ops (`attention.LAYOUT_OPS`) care about. So,
as vLLM and TensorRT-LLM's AutoDeploy do, the graph is cut at those ops (split_piecewise marks
where, `split` builds the split graph of its segments) and:

- every step that is not decode-only is padded to the smallest token bucket that holds it; the
  padding is one extra sequence of the missing tokens, nothing cached, its page-table row at the
  scratch page, so the layout ops see a consistent batch and its cache writes land nowhere that
  matters; outputs are sliced back to the real tokens;
- each static segment runs per bucket: replayed from a CUDA graph (torch-cudagraph, torch-opt,
  captured at the bucket's first step), compiled by Inductor (torch-compile, torch-opt), or as it
  is (the CPU path of the capturing backends, which tests drive); the layout segments run eagerly
  between them on the padded step, its extra sequence one more to them;
- decode-only steps, and steps past the largest bucket, go to the full graph (`full_fn`: the
  decode runner's replays, or the compiled graph), as AutoDeploy's dual mode does.

Memory: every capture shares one pool (`torch.cuda.graph_pool_handle`); a static segment's
outputs are the next one's inputs as they are (their addresses are the pool's, fixed across
replays), weights are the graph's own attributes, never copied; what a layout op returns is copied
into the buffer its consumer was captured reading. Each bucket's segment outputs stay allocated
in the pool, so the pool grows with the sum of the buckets (`models/memory.piecewise_pool_bytes`
estimates it before the run).
"""

from __future__ import annotations

import bisect
import operator
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from pipeline.backends.cudagraph import pick_bucket, slice_output, step_shape, token_dim
from pipeline.graphs import SEGMENT, first_tensor, record_of

STEP_INPUTS = ("qo_indptr", "cache_lens", "page_table")  # per sequence: the layout ops' alone


def split(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph as its segments (record.segments, each node's index in its meta): a top-level
    GraphModule with the same inputs and output structure that calls `segment_<i>` in order, each a
    GraphModule over the graph's own parameters (attributes are shared, not copied). A segment
    returns a tuple of what later segments or the output read."""
    record = record_of(gm)
    segments = record.segments
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    segment_of = {n: n.meta[SEGMENT] for n in nodes}
    outputs: list[list[fx.Node]] = [[] for _ in segments]
    for node in nodes:
        users = [u for u in node.users if u.op == "output" or segment_of.get(u) != segment_of[node]]
        if users:
            outputs[segment_of[node]].append(node)

    top = fx.Graph()
    top_env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            top_env[node] = top.node_copy(node)
    holder = nn.Module()
    for segment in segments:
        graph, env, inputs = fx.Graph(), {}, []

        def value_of(arg: fx.Node, graph=graph, env=env, inputs=inputs) -> fx.Node:
            if arg not in env:
                if arg.op == "get_attr":
                    env[arg] = graph.get_attr(arg.target)
                else:  # a graph input or an earlier segment's value
                    env[arg] = graph.placeholder(arg.name)
                    env[arg].meta = dict(arg.meta)
                    inputs.append(arg)
            return env[arg]

        members = [n for n in nodes if segment_of[n] == segment.index]
        for node in members:
            for arg in node.all_input_nodes:
                if segment_of.get(arg) != segment.index:
                    value_of(arg)
            env[node] = graph.node_copy(node, lambda a, env=env: env[a])
        graph.output(tuple(env[n] for n in outputs[segment.index]))
        module = fx.GraphModule(gm, graph, class_name=f"Segment{segment.index}")
        name = f"segment_{segment.index}"
        holder.add_module(name, module)
        call = top.call_module(name, tuple(top_env[a] for a in inputs))
        for i, node in enumerate(outputs[segment.index]):
            top_env[node] = top.call_function(operator.getitem, (call, i))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    top.output(fx.map_arg(output.args[0], lambda a: top_env[a]))
    top._codegen = gm.graph._codegen  # the same pytree of kwargs in and outputs out
    return fx.GraphModule(holder, top, class_name="PiecewiseGraph")


@dataclass
class BucketUse:
    """What one token bucket ran: steps, their real and padded tokens, their times."""

    steps: int = 0
    tokens: int = 0  # real tokens over its steps
    # read from the tensors the static segments received: the tokens each step's segments ran
    # (padding included), how many segment calls, and every token count a segment saw
    padded_tokens: int = 0
    segment_calls: int = 0
    received: set[int] = field(default_factory=set)
    seconds: list[float] = field(default_factory=list)


@dataclass
class PiecewiseStats:
    buckets: dict[int, BucketUse] = field(default_factory=dict)
    uncaptured: Counter = field(default_factory=Counter)  # reason -> steps
    decode_steps: int = 0  # decode-only steps, run by the full graph
    observed: list[int] = field(default_factory=list)  # every non-decode step's real tokens
    pending: list[tuple[int, Any, Any]] = field(default_factory=list)  # (bucket, start, end) CUDA events

    def settle(self) -> None:
        """Read the CUDA events of the timed steps (at the end, never per step: a step would wait)."""
        for bucket, start, end in self.pending:
            end.synchronize()
            self.buckets[bucket].seconds.append(start.elapsed_time(end) / 1000)
        self.pending.clear()


def _tokens_received(args: tuple[Any, ...]) -> int:
    """The packed tokens a segment call received: the token dim of its [1, T, ...] (or multimodal
    [3, 1, T]) tensor inputs, the largest."""
    sizes = [0]
    for value in args:
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.dim() == 3 and tuple(value.shape[:2]) == (3, 1):
                sizes.append(value.shape[2])
            elif value.shape[0] == 1:
                sizes.append(value.shape[1])
    return max(sizes)


class StaticSegment:
    """One static segment's calls per bucket: its forward as it is or compiled, or its CUDA graph
    per bucket (captured at the bucket's first call, into the shared pool)."""

    def __init__(self, forward: Callable, runner: PiecewiseRunner, copied: list[int]):
        """copied: the positions of the arguments made outside the captures (a layout op's outputs,
        the graph's inputs): copied into the buffers the graph was captured reading, unless they
        are those buffers (a bucket's padded token inputs)."""
        self.forward, self.runner, self.copied = forward, runner, copied
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[Any], Any]] = {}

    def __call__(self, *args: Any) -> Any:
        runner = self.runner
        if runner.bucket is not None:
            runner.received.append(_tokens_received(args))
        if not runner.use_graphs or runner.bucket is None:
            return self.forward(*args)
        bucket = runner.bucket
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(list(args))
        graph, inputs, output = self.graphs[bucket]
        for i in self.copied:
            if args[i].data_ptr() != inputs[i].data_ptr():
                if args[i].shape != inputs[i].shape:
                    raise RuntimeError(
                        f"a replay of bucket {bucket} got an input of shape {tuple(args[i].shape)}, "
                        f"captured as {tuple(inputs[i].shape)}: run without backend.piecewise"
                    )
                inputs[i].copy_(args[i])
        graph.replay()
        return output

    def _capture(self, args: list[Any]) -> tuple[torch.cuda.CUDAGraph, list[Any], Any]:
        self.copied = [i for i in self.copied if isinstance(args[i], torch.Tensor)]  # not sizes
        own = {id(t) for t in self.runner.buffers[self.runner.bucket].values()}
        for i in self.copied:  # the buffers replays copy into
            if id(args[i]) not in own:
                args[i] = args[i].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # outside the graph: allocator, autotuning, compilation
                self.forward(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.runner.pool):
            output = self.forward(*args)
        return graph, args, output


class PiecewiseRunner(nn.Module):
    """Sits behind a cached graph's kwargs adapter (a submodule, so profilers see it): decode-only
    steps and steps past the largest bucket go to `full_fn`; every other step is padded to its
    bucket and runs `split_graph`, the graph's segments with the static ones wrapped in StaticSegment."""

    def __init__(
        self,
        split_graph: fx.GraphModule,
        full_fn: Callable[..., Any],
        buckets: list[int],
        scratch_page: int,
        page_size: int,
        caches: frozenset[str],
        use_graphs: bool,
        max_tokens: int,
    ):
        super().__init__()
        self.split_graph, self.full_fn = split_graph, full_fn
        self.max_tokens = max_tokens  # runtime.max_num_tokens: the suggested set's last bucket
        self.received: list[int] = []  # tokens each static segment of the running step received
        self.kinds: dict[str, str] = {}  # segment module name -> static | layout | head (install)
        self.buckets = sorted(set(buckets))
        self.scratch_page, self.page_size, self.caches = scratch_page, page_size, caches
        self.use_graphs = use_graphs
        self.compiled = False  # the static segments compiled by Inductor (install)
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.stats = PiecewiseStats()
        self.pool_by_bucket: dict[int, int] = {}  # device memory each bucket's captures reserved
        self.bucket: int | None = None  # the bucket of the step running now (StaticSegment reads it)
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}  # bucket -> its padded token inputs
        self.segments: dict[str, StaticSegment] = {}

    def forward(self, **inputs: Any) -> Any:
        rows = first_tensor(inputs).shape[0]
        if rows != 1:  # a plain batch (the stages' checks): the segments run as they are, no bucket
            self.stats.uncaptured[f"a batch of {rows} rows, not one packed row: segments uncaptured"] += 1
            self.bucket = None
            return self.split_graph(**inputs)
        sequences, tokens = step_shape(inputs)
        if sequences == tokens:
            self.stats.decode_steps += 1
            return self.full_fn(**inputs)
        self.stats.observed.append(tokens)
        bucket = pick_bucket(tokens, self.buckets)
        if bucket is None:
            self.stats.uncaptured[f"more tokens than the largest bucket ({self.buckets[-1]})"] += 1
            return self.full_fn(**inputs)
        self.bucket = bucket
        use = self.stats.buckets.setdefault(bucket, BucketUse())
        first = bucket not in self.buffers
        reserved = torch.cuda.memory_reserved() if self.use_graphs and first else 0
        timer = self._start()
        self.received = []
        output = self.split_graph(**self._padded(inputs, tokens, bucket))
        self._stop(bucket, use, timer)
        use.padded_tokens += max(self.received, default=0)
        use.segment_calls += len(self.received)
        use.received.update(self.received)
        if self.use_graphs and first:
            self.pool_by_bucket[bucket] = torch.cuda.memory_reserved() - reserved
        use.steps += 1
        use.tokens += tokens
        return slice_output(output, tokens, bucket)

    def _start(self) -> Any:
        if self.use_graphs:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _stop(self, bucket: int, use: BucketUse, start: Any) -> None:
        if self.use_graphs:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats.pending.append((bucket, start, end))
        else:
            use.seconds.append(time.perf_counter() - start)

    def _padded(self, inputs: dict[str, Any], tokens: int, bucket: int) -> dict[str, Any]:
        """The step as a bucket's: token inputs copied into the bucket's buffers (a fixed address
        per bucket, which the captures read), the sequence inputs given one more sequence of the
        bucket - tokens padding tokens (computed on the device: the host never waits)."""
        pad = bucket - tokens
        buffers = self.buffers.setdefault(bucket, {})
        padded: dict[str, Any] = {}
        for name, value in inputs.items():
            if not isinstance(value, torch.Tensor) or name in self.caches or name in STEP_INPUTS:
                padded[name] = value
                continue
            dim = 0 if name == "token_block" else token_dim(value, tokens)  # token_block: [T, 2]
            if dim is None:
                padded[name] = value
                continue
            if name not in buffers:
                shape = value.shape[:dim] + (bucket,) + value.shape[dim + 1 :]
                buffers[name] = value.new_zeros(shape)
            buffer = buffers[name]
            buffer.narrow(dim, 0, tokens).copy_(value)  # padding tokens: any finite values serve
            padded[name] = buffer
        if pad:
            qo_indptr, cache_lens, table = (inputs[name] for name in STEP_INPUTS)
            padded["qo_indptr"] = torch.cat([qo_indptr, qo_indptr[-1:] + pad])
            padded["cache_lens"] = torch.cat([cache_lens, cache_lens.new_zeros(1)])
            width = max(table.shape[1], -(-pad // self.page_size))
            table = nn.functional.pad(table, (0, width - table.shape[1]), value=-1)
            padded["page_table"] = torch.cat([table, table.new_full((1, width), self.scratch_page)])
        return padded

    @property
    def segments_run(self) -> str:
        """How the static segments run, in words."""
        if self.use_graphs:
            return "replayed from CUDA graphs" + (" of Inductor's code" if self.compiled else "")
        return "compiled by Inductor" if self.compiled else "run uncaptured (CUDA graphs need a GPU)"

    def pool_bytes(self) -> int:
        return sum(self.pool_by_bucket.values())

    def report(self) -> dict[str, Any]:
        """What the steps since the last `stats` reset did: per bucket used, its steps, real and
        padded tokens, the padding share and the mean step time; the steps the segments did not run
        and why; and the bucket set `suggest` finds for the same steps."""
        self.stats.settle()
        stats = self.stats
        rows = []
        for bucket in sorted(stats.buckets):
            use = stats.buckets[bucket]
            padded = use.padded_tokens
            rows.append(
                {
                    "bucket": bucket,
                    "steps": use.steps,
                    "tokens": use.tokens,
                    "padded_tokens": padded,
                    "segment_calls": use.segment_calls,
                    "segment_tokens": sorted(use.received),
                    "padding_pct": 100 * (padded - use.tokens) / padded if padded else 0.0,
                    "mean_ms": 1000 * sum(use.seconds) / len(use.seconds) if use.seconds else None,
                    "pool_mb": self.pool_by_bucket.get(bucket, 0) / 2**20,
                }
            )
        suggested, suggested_waste = suggest(stats.observed, self.buckets, self.max_tokens)
        return {
            "segments_run": self.segments_run,
            "buckets": self.buckets,
            "rows": rows,
            "decode_steps": stats.decode_steps,
            "uncaptured": dict(stats.uncaptured),
            "padding_tokens": sum(r["padded_tokens"] - r["tokens"] for r in rows),
            "suggested": suggested,
            "suggested_from_steps": sum(1 for t in stats.observed if t <= self.max_tokens),
            "suggested_padding_tokens": suggested_waste,
            "pool_mb": self.pool_bytes() / 2**20,
        }

    def buffer_bytes(self) -> int:
        """The padded token inputs of every bucket and the layout outputs' capture buffers."""
        inputs = sum(t.numel() * t.element_size() for b in self.buffers.values() for t in b.values())
        copies = sum(
            graph_inputs[i].numel() * graph_inputs[i].element_size()
            for segment in self.segments.values()
            for _, graph_inputs, _ in segment.graphs.values()
            for i in segment.copied
        )
        return inputs + copies


def install(
    graph: fx.GraphModule,
    buckets: list[int],
    scratch_page: int,
    page_size: int,
    capture_head: bool,
    compile_segment: Callable[[fx.GraphModule, str], None] | None,
    use_graphs: bool,
    max_tokens: int,
) -> PiecewiseRunner:
    """Put a PiecewiseRunner behind the graph's kwargs adapter, in front of the forward the graph
    has now (the decode runner's, or the compiled graph's). compile_segment: what the compiling
    backends do to each static segment (and the head), given it and its name, before it is wrapped."""
    record = record_of(graph)
    split_graph = split(graph)
    if use_graphs:  # before any capture: a replay reads its inputs at the shapes it was captured at
        kinds = {f"segment_{s.index}": s.kind for s in record.segments}
        if bad := not_per_token(
            graph, split_graph, kinds, frozenset(spec.input_name for spec in record.cache_specs)
        ):
            raise ValueError(
                f"backend.piecewise: {bad[0]} is copied into a segment's captured buffer but its shape "
                "does not follow the step's tokens, so a replay would meet another shape; run without "
                "backend.piecewise"
            )
    runner = PiecewiseRunner(
        split_graph,
        graph.forward,
        buckets,
        scratch_page,
        page_size,
        frozenset(spec.input_name for spec in record.cache_specs),
        use_graphs,
        max_tokens,
    )
    runner.compiled = compile_segment is not None
    kinds = runner.kinds = {f"segment_{s.index}": s.kind for s in record.segments}
    produced_by_layout = _layout_values(split_graph, kinds)
    for node in split_graph.graph.nodes:
        if node.op != "call_module" or kinds[node.target] == "layout":
            continue
        if any(a.op == "placeholder" and a.target in STEP_INPUTS for a in node.all_input_nodes):
            raise ValueError(
                f"{node.target} reads the step's sequence inputs outside a layout op: it cannot be "
                "replayed per token bucket; run without backend.piecewise"
            )
        segment = split_graph.get_submodule(node.target)
        if compile_segment is not None:
            compile_segment(segment, node.target)
        if kinds[node.target] == "head" and not capture_head:
            continue  # runs as it is (or compiled) after the replays
        # The class's forward read at each call: a profiler's module ranges recompile the segment.
        forward = segment.forward if compile_segment is not None else _class_forward(segment)
        copied = [
            i
            for i, a in enumerate(node.args)
            if isinstance(a, fx.Node)
            and (a in produced_by_layout or (a.op == "placeholder" and a.target not in runner.caches))
        ]
        wrapped = runner.segments[node.target] = StaticSegment(forward, runner, copied)
        segment.forward = wrapped
    graph.add_module("piecewise_runner", runner)
    graph.forward = lambda **inputs: graph.piecewise_runner(**inputs)
    return runner


def not_per_token(
    graph: fx.GraphModule, split_graph: fx.GraphModule, kinds: dict[str, str], caches: frozenset[str]
) -> list[str]:
    """The inputs a static segment's replay would copy (graph inputs other than the caches, layout
    outputs) whose shapes, as export recorded them, have a size other than the token inputs'
    (`<segment>'s input <name> [shape]`): such an input changes shape between steps of one bucket."""
    token_inputs = [
        n for n in graph.graph.nodes if n.op == "placeholder" and n.target in ("input_ids", "inputs_embeds")
    ]
    allowed = {
        str(d) for n in token_inputs if isinstance(v := n.meta.get("val"), torch.Tensor) for d in v.shape
    }
    produced_by_layout = _layout_values(split_graph, kinds)
    bad = []
    for node in split_graph.graph.nodes:
        if node.op != "call_module" or kinds[node.target] != "static":
            continue
        placeholders = [
            n for n in split_graph.get_submodule(node.target).graph.nodes if n.op == "placeholder"
        ]
        for arg, placeholder in zip(node.args, placeholders, strict=True):
            copied = arg in produced_by_layout or (arg.op == "placeholder" and arg.target not in caches)
            value = placeholder.meta.get("val")
            if not copied or not isinstance(value, torch.Tensor):
                continue
            if any(not isinstance(d, int) and str(d) not in allowed for d in value.shape):
                bad.append(f"{node.target}'s input {placeholder.name} {list(value.shape)}")
    return bad


def _class_forward(module: fx.GraphModule) -> Callable[..., Any]:
    return lambda *args: type(module).forward(module, *args)


def _layout_values(split_graph: fx.GraphModule, kinds: dict[str, str]) -> set[fx.Node]:
    """The top-level values a layout segment returns (its outputs' getitem nodes)."""
    return {
        user
        for node in split_graph.graph.nodes
        if node.op == "call_module" and kinds[node.target] == "layout"
        for user in node.users
    }


def suggest(observed: list[int], buckets: list[int], max_tokens: int) -> tuple[list[int], int]:
    """The bucket set that would have padded the observed steps least, always ending at max_tokens
    (runtime.max_num_tokens), so a step longer than any seen still runs the segments, with no more
    buckets below it than now below the largest and a sum of those no larger (the pool holds every
    bucket's segment outputs, so it grows with the sum); and the padding it would have wasted.
    Buckets are drawn from the observed sizes (an optimal set never needs others), searched whole
    over the 12 most frequent ones."""
    fitting = sorted(t for t in observed if t <= max_tokens)
    if not fitting:
        return list(buckets), 0
    counts = Counter(fitting)
    others = sorted({t for t, _ in counts.most_common(12)} - {max_tokens})
    budget, limit = sum(buckets) - max(buckets), len(buckets) - 1
    best: tuple[int, list[int]] | None = None
    for mask in range(1 << len(others)):
        below = [t for i, t in enumerate(others) if mask >> i & 1]
        if len(below) > limit or sum(below) > budget:
            continue
        chosen = [*below, max_tokens]
        waste = sum(n * (chosen[bisect.bisect_left(chosen, t)] - t) for t, n in counts.items())
        if best is None or waste < best[0] or (waste == best[0] and len(chosen) < len(best[1])):
            best = (waste, chosen)
    return best[1], best[0]  # [max_tokens] alone always fits


def runners(model: nn.Module) -> list[PiecewiseRunner]:
    return [m for m in model.modules() if isinstance(m, PiecewiseRunner)]

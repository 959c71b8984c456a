"""Per-layer numerics: where the changed model first leaves the eager one.

On the check calls, the output of every part of the model (the vision tower, the projector, each
decoder layer of the language model, the lm_head) is compared with Hugging Face's eager model's on
the same calls: the largest absolute difference, and the same relative to the reference part's
largest magnitude against the dtype's tolerance (correctness.TOLERANCE); the first part past it,
in the order a forward runs them, is named. Tokens an MoE router decided by a near-tie in eager
are left out, as the logits check leaves them out (correctness.NEAR_TIE_ULPS).

A decode step is compared too, through the program generation runs: one request of the text
call's first row, prefilled then decoded one token by demollm (Hugging Face's eager model under
the eager runner, as generate runs it, for the reference; the captured model under the paged
runner, its cache and its backend), each part's output read at the decode step (`decode_parts`).

Eager parts are read with forward hooks. A decoder layer inside a captured graph has no module to
hook: export tags the node whose value is the layer's output (`layer_output` in its meta), graph
rewrites carry the tag to the node that takes its place (transforms/graph.replace), and a copy of
the graph returns the tagged values beside its outputs. Under a compiling backend the copy is
compiled as the graph was, so the values are those of the backend's code.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from pipeline.graphs import LAYER_OUTPUT, find_graphs
from pipeline.profiler.ranges import node_stack

VISION = re.compile(r"vision|visual|image_encoder")
PROJECTOR = re.compile(r"projector|multi_modal|mm_proj|connector")


def part_paths(model: nn.Module, lm_paths: list[str]) -> list[str]:
    """The parts, in the order a forward runs them: the vision tower and projector of a VLM (the
    outermost modules named so, outside the language model), each decoder layer, the lm_head."""
    outside: list[str] = []
    for kind in (VISION, PROJECTOR):
        for path, _ in model.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            inside = any(path.startswith(p + ".") for p in lm_paths + outside)
            if path and kind.search(leaf) and not inside:
                outside.append(path)
                break
    layers = [
        f"{lm}.layers.{i}" if lm else f"layers.{i}" for lm in lm_paths for i in range(_count(model, lm))
    ]
    head = ["lm_head"] if isinstance(getattr(model, "lm_head", None), nn.Module) else []
    return outside + layers + head


def _count(model: nn.Module, lm_path: str) -> int:
    return len((model.get_submodule(lm_path) if lm_path else model).layers)


def tag_layer_outputs(gm: fx.GraphModule, graph_path: str, layer_paths: list[str]) -> int:
    """Tag, for each decoder layer inside the graph, the last of its nodes whose value leaves the
    layer: its output (the residual stream after it). Returns how many were tagged."""
    nodes = list(gm.graph.nodes)
    tagged = 0
    for layer in layer_paths:
        if graph_path and not layer.startswith(graph_path + "."):
            continue
        inner = layer[len(graph_path) + 1 :] if graph_path else layer

        def within(node: fx.Node, inner=inner) -> bool:
            stack = node_stack(node) or []
            return any(path == inner or path.startswith(inner + ".") for _, path, _ in stack)

        mine = [n for n in nodes if n.op == "call_function" and within(n)]
        leaving = [n for n in mine if any(u.op == "output" or not within(u) for u in n.users)]
        if leaving:
            leaving[-1].meta[LAYER_OUTPUT] = layer
            tagged += 1
    return tagged


def tapped(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """A copy of the graph (sharing its weights) that returns (its outputs, [each tagged layer's
    output]), and the layers, in graph order."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, env)
    taps = [(n.meta[LAYER_OUTPUT], env[n]) for n in gm.graph.nodes if LAYER_OUTPUT in n.meta]
    info = gm.graph._codegen.pytree_info
    leaves = list(output) if isinstance(output, (tuple, list)) else [output]
    structure = pytree.tree_unflatten(list(range(len(leaves))), info.out_spec)
    graph.output(tuple(leaves) + tuple(node for _, node in taps))
    out_spec = pytree.tree_structure((structure, list(range(len(taps)))))
    graph._codegen = type(gm.graph._codegen)(type(info)(info.orig_args, info.in_spec, out_spec))
    return fx.GraphModule(gm, graph), [layer for layer, _ in taps]


def _first_tensor(value: Any) -> torch.Tensor | None:
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    return leaves[0] if leaves else None


@contextmanager
def recorded(model: nn.Module, paths: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Each named module's output (its first tensor) from the calls made inside, as float32 on the
    host; modules not in the model are left out."""
    found: dict[str, torch.Tensor] = {}
    named = dict(model.named_modules())
    hooks = []
    for path in paths:
        if path in named and not isinstance(named[path], fx.GraphModule):

            def hook(_module, _args, output, path=path):
                tensor = _first_tensor(output)
                if tensor is not None:
                    found[path] = tensor.detach().float().cpu()

            hooks.append(named[path].register_forward_hook(hook))
    try:
        yield found
    finally:
        for handle in hooks:
            handle.remove()


@dataclass
class DecodeParts:
    """Each part's output at one decode step, and the tokens the request generated (the decode
    step's input is the first)."""

    prompt: list[int]
    parts: dict[str, torch.Tensor]
    tokens: list[int]


def decode_parts(
    model: nn.Module,
    hf_config,
    runtime,
    device: torch.device,
    prompt: list[int],
    parts: list[str],
    compile_copy,
) -> DecodeParts:
    """Prefill `prompt` and decode one token with demollm on the model as it is (greedy), reading
    each part's output at the decode step: eager modules by forward hooks, the layers inside a
    captured graph by its tapped copy (compile_copy applied to it), run on the kwargs the graph
    received at that step, before the graph runs it (the copy writes the step's keys and values
    into the cache where the graph writes them too)."""
    from pipeline.runtime.engine import DemoLLM
    from pipeline.runtime.requests import Request
    from pipeline.runtime.sampling import SamplingParams

    engine = DemoLLM(model, hf_config, runtime, device, eos_ids=set())
    inside: dict[str, torch.Tensor] = {}
    copies = {}
    hooks = []
    steps: list[str] = []
    for name, gm in find_graphs(model):

        def tap(_module, _args, kwargs, gm=gm, name=name):
            if not steps or steps[-1] != "prefill" or name not in copies:
                return  # only the decode step, the one after the prefill
            copy, layers = copies[name]
            with torch.no_grad():
                _, values = copy(**kwargs)
            inside.update({layer: v.detach().float().cpu() for layer, v in zip(layers, values, strict=True)})

        copy, layers = tapped(gm)
        compile_copy(copy)
        copies[name] = (copy, layers)
        hooks.append(gm.register_forward_pre_hook(tap, with_kwargs=True))
    try:
        with recorded(model, parts) as eager:
            generation = engine.generate(
                [Request(0, list(prompt))], 2, SamplingParams(), seed=0, after_step=steps.append
            )
    finally:
        for handle in hooks:
            handle.remove()
    return DecodeParts(list(prompt), eager | inside, generation.tokens[0])


def graph_layer_outputs(model: nn.Module, call: dict[str, Any], compile_copy) -> dict[str, torch.Tensor]:
    """Run the model on `call`, and each captured graph's tapped copy (compile_copy applied to it)
    on the kwargs that graph received: the tagged layers' outputs."""
    found: dict[str, torch.Tensor] = {}
    received: dict[str, dict] = {}
    hooks = []
    for name, gm in find_graphs(model):

        def keep(_module, _args, kwargs, name=name):
            received[name] = dict(kwargs)  # after the kwargs adapter (registered before, prepended)

        hooks.append(gm.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**call)
    finally:
        for handle in hooks:
            handle.remove()
    for name, gm in find_graphs(model):
        if name not in received:
            continue
        copy, layers = tapped(gm)
        compile_copy(copy)
        with torch.no_grad():
            _, values = copy(**received[name])
        found |= {layer: value.detach().float().cpu() for layer, value in zip(layers, values, strict=True)}
    return found


@dataclass
class PartError:
    part: str
    max_abs: float | None  # None: the part's output could not be read on the changed model
    max_rel: float | None
    past_tolerance: bool


def compare(
    reference: dict[str, torch.Tensor], changed: dict[str, torch.Tensor], parts: list[str], tolerance: float,
    near_ties: torch.Tensor | None = None,
) -> list[PartError]:  # fmt: skip
    """Each part's max abs / rel difference; near_ties [B, S] masks the tokens to leave out of
    parts shaped [B, S, ...]."""
    errors = []
    for part in parts:
        if part not in reference:
            continue
        if part not in changed or changed[part].shape != reference[part].shape:
            errors.append(PartError(part, None, None, False))
            continue
        diff = (changed[part] - reference[part]).abs()
        scale = reference[part].abs()
        if near_ties is not None and near_ties.any() and diff.shape[:2] == near_ties.shape:
            diff, scale = diff[~near_ties], scale[~near_ties]
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = max_abs / max(float(scale.max()) if scale.numel() else 0.0, 1e-30)
        errors.append(PartError(part, max_abs, max_rel, max_rel > tolerance))
    return errors


def _badness(error: PartError) -> float:
    """How far a part is from eager: not readable at all is worst."""
    return float("inf") if error.max_rel is None else error.max_rel


def measure(
    model: nn.Module, reference, calls: dict[str, dict], tolerance: float, compile_copy
) -> list[PartError]:
    """Each part of `reference.part_order` on the model now, its worst over the calls (a part not
    readable on any call stays so), in forward order. reference: correctness's Reference."""
    worst: dict[str, PartError] = {}
    for name, call in calls.items():
        with recorded(model, reference.part_order) as eager_parts:
            inside = graph_layer_outputs(model, call, compile_copy)
        near = reference.router_near_ties.get(name)
        for error in compare(
            reference.parts[name], eager_parts | inside, reference.part_order, tolerance, near
        ):
            kept = worst.get(error.part)
            if kept is None or _badness(error) > _badness(kept):
                worst[error.part] = error
    return [worst[p] for p in reference.part_order if p in worst]

"""Small helpers the graph rewrites share: node predicates, meta copying, finishing a rewrite."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

INT64_MAX = 9223372036854775807


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def replace(old: fx.Node, new: fx.Node) -> None:
    """Redirect old's users to new, which inherits old's meta (shape, source, nn_module_stack)."""
    for key, value in old.meta.items():
        new.meta.setdefault(key, value)
    old.replace_all_uses_with(new)


def common_module_stack(nodes: Iterable[fx.Node]) -> dict:
    """The nn_module_stack entries all nodes share: a fused node belongs to their common parent."""
    stacks = [list(n.meta.get("nn_module_stack", {}).items()) for n in nodes]
    common = []
    for entries in zip(*stacks, strict=False):
        if all(e == entries[0] for e in entries):
            common.append(entries[0])
        else:
            break
    return dict(common)


def finish(gm: fx.GraphModule) -> None:
    """After every rewrite: drop dead nodes, check, recompile."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def drop_parameters(gm: fx.GraphModule, targets: Iterable[str]) -> None:
    """Delete parameters a rewrite replaced, once no node reads them, and modules left empty.
    Only the named ones: others unused by the graph (the input embedding) serve the eager parent."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for target in targets:
        if target in used:
            continue
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        owner._parameters.pop(leaf, None)
        if owner_path and not (owner._parameters or owner._buffers or owner._modules):
            parent_path, _, name = owner_path.rpartition(".")
            del gm.get_submodule(parent_path)._modules[name]


def fake_value(fn, *args) -> Any:
    """Run fn on the fake values of fx-node args (real tensors are fakeified) for a new node's meta."""
    values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    mode = next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)
    if mode is None:
        return None
    with mode:
        values = [
            mode.from_tensor(v) if isinstance(v, torch.Tensor) and not hasattr(v, "fake_mode") else v
            for v in values
        ]
        return fn(*values)


def add_inputs(gm: fx.GraphModule, names: list[str]) -> list[fx.Node]:
    """New kwargs inputs of an exported graph module: placeholders, and the pytree input spec its
    generated forward unpacks (the graph stays kwargs-only). Export's own input-constraint hook
    checks the inputs it was exported with, so it goes."""
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
    from torch.utils import _pytree as pytree

    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    nodes = []
    for name in names:
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(name)
        nodes.append(last)
    codegen = gm.graph._codegen
    all_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    spec = pytree.tree_structure(((), dict.fromkeys(all_names, 0)))
    gm.graph._codegen = _PyTreeCodeGen(_PyTreeInfo(all_names, spec, codegen.pytree_info.out_spec))
    gm._in_spec = spec
    for key, hook in list(gm._forward_pre_hooks.items()):
        if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
            del gm._forward_pre_hooks[key]
    return nodes

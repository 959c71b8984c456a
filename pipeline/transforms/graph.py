"""Small helpers the graph rewrites share: node predicates, meta copying, finishing a rewrite."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from pipeline.graphs import LAYER_OUTPUT

aten = torch.ops.aten

INT64_MAX = 9223372036854775807


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def replace(old: fx.Node, new: fx.Node) -> None:
    """Redirect old's users to new, which inherits old's meta (shape, source, nn_module_stack) and
    takes over its layer-output tag (old, now dead, then goes)."""
    for key, value in old.meta.items():
        new.meta.setdefault(key, value)
    old.meta.pop(LAYER_OUTPUT, None)
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


def drop_dead(gm: fx.GraphModule) -> None:
    """Dead-code elimination that keeps a layer's tagged output: the per-layer numerics read it, and
    where nothing does it costs nothing (a compiler drops it again)."""
    gm.graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure() or LAYER_OUTPUT in node.meta)


def finish(gm: fx.GraphModule) -> None:
    """After every rewrite: drop dead nodes, check, recompile."""
    drop_dead(gm)
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


def graph_kwargs(gm: fx.GraphModule) -> dict[str, Any]:
    """Each kwarg of an exported graph's forward -> its placeholder, or the container of them its
    input spec unpacks (a dict of masks, say)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    _, kwargs = pytree.tree_unflatten(placeholders, gm.graph._codegen.pytree_info.in_spec)
    return dict(kwargs)


def set_graph_kwargs(gm: fx.GraphModule, kwargs: dict[str, Any]) -> None:
    """The graph's forward takes exactly these kwargs (placeholders, or containers of them, in the
    graph's placeholder order): its input spec and generated forward follow. Export's own checks of
    the inputs it was exported with (its input-constraint hook, and the `_guards_fn` node that
    reads every input) go."""
    _drop_export_guards(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if pytree.tree_leaves(kwargs) != placeholders:
        raise ValueError(f"{type(gm).__name__}: the kwargs' placeholders are not the graph's, in order")
    spec = pytree.tree_structure(((), kwargs))
    out_spec = gm.graph._codegen.pytree_info.out_spec
    gm.graph._codegen = _PyTreeCodeGen(_PyTreeInfo(list(kwargs), spec, out_spec))
    gm._in_spec = spec
    for key, hook in list(gm._forward_pre_hooks.items()):
        if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
            del gm._forward_pre_hooks[key]


def _drop_export_guards(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")


def add_inputs(gm: fx.GraphModule, names: list[str]) -> list[fx.Node]:
    """New kwargs inputs of an exported graph module, after its others (the graph stays kwargs-only)."""
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    kwargs = graph_kwargs(gm)
    nodes = []
    for name in names:
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(name)
        nodes.append(last)
        kwargs[name] = last
    set_graph_kwargs(gm, kwargs)
    return nodes


def _reroute_sizes(leaf: fx.Node, kept: list[fx.Node]) -> None:
    """Point the `sym_size` reads of `leaf` at a kept input with the same symbolic size: export takes
    the batch size from whichever input it met first (HF's mask, say)."""
    for user in list(leaf.users):
        size = user.meta.get("val")
        if not (is_op(user, aten.sym_size.int) and isinstance(size, torch.SymInt)):
            continue
        for other in kept:
            value = other.meta.get("val")
            shape = value.shape if isinstance(value, torch.Tensor) else ()
            dim = next(
                (
                    d
                    for d, s in enumerate(shape)
                    if isinstance(s, torch.SymInt) and s.node.expr == size.node.expr
                ),
                None,
            )
            if dim is not None:
                user.args = (other, dim)
                break


def drop_unused_inputs(gm: fx.GraphModule) -> list[str]:
    """Remove the kwargs no node reads any more (HF's mask once cached attention replaced the
    attention that read it; a read of its size goes to another input of that size); returns their
    names."""
    _drop_export_guards(gm)
    kwargs = graph_kwargs(gm)
    leaves_of = {name: pytree.tree_leaves(value) for name, value in kwargs.items()}

    def only_sizes_read(leaves: list[fx.Node]) -> bool:
        return all(is_op(user, aten.sym_size.int) for leaf in leaves for user in leaf.users)

    # Inputs something computes with keep their sizes; the others' size reads move to them
    kept = [leaf for leaves in leaves_of.values() if not only_sizes_read(leaves) for leaf in leaves]
    dropped = []
    for name, leaves in leaves_of.items():
        if not leaves or not only_sizes_read(leaves):
            continue
        for leaf in leaves:
            _reroute_sizes(leaf, kept)
        if not any(leaf.users for leaf in leaves):
            for leaf in leaves:
                gm.graph.erase_node(leaf)
            del kwargs[name]
            dropped.append(name)
    set_graph_kwargs(gm, kwargs)
    return dropped

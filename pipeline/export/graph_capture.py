"""Partial graph capture: export a submodule kwargs-only and put the graph back in its place.

The first seed's two changes live here: a graph nested inside a larger nn.Module, and kwargs-only
inputs. The kwargs a submodule really receives are recorded by running the whole model once with a
forward pre-hook on it; tensors, and dicts/lists/tuples of tensors (Gemma 3's mask per layer type),
become graph inputs (export flattens containers through the pytree), other values constants of the
export, and None values are dropped. Three pitfalls measured on this machine are handled (see
../shared/reference/seed-models.md): constants must go into the export, the parent still asks the
graph for its input embeddings, and the exported module rejects kwargs it was not exported with.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import time
import typing
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.fx.experimental import _config as shape_config
from torch.utils import _pytree as pytree

from pipeline.graphs import GraphRecord, VisionInput, first_tensor, record_of, set_record
from pipeline.models import cross_attention, image_mask
from pipeline.models import images as imaging
from pipeline.models.probe import first_calls

_PRIMITIVES = (bool, int, float, str)


class ExportError(Exception):
    pass


class ExportFailed(Exception):
    """torch.export raised (the cause is chained); `console` is what it printed meanwhile."""

    def __init__(self, console: str, path: str = ""):
        super().__init__(f"torch.export of '{path or 'root'}' failed")
        self.console = console
        self.path = path


def _tensor_tree(value: Any) -> bool:
    """A dict, list or tuple whose leaves are all tensors (None entries allowed)."""
    if not isinstance(value, dict | list | tuple):
        return False
    leaves = [leaf for leaf in pytree.tree_leaves(value) if leaf is not None]
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def describe(value: Any) -> str:
    """What an object is, for a message: its class with its module, and what it holds."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, dict | list | tuple):
        kinds = sorted({type(leaf).__name__ for leaf in pytree.tree_leaves(value)})
        return f"{kind} holding {', '.join(kinds) or 'nothing'}"
    return kind


@dataclass
class RecordedCall:
    kwargs: dict[str, Any]  # the call as the parent made it, positional args bound to their names

    def split(self) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """(graph inputs: tensors and containers of tensors, export constants, dropped None names)."""
        tensors, constants, dropped = {}, {}, []
        for name, value in self.kwargs.items():
            if isinstance(value, torch.Tensor) or _tensor_tree(value):
                tensors[name] = value
            elif value is None or (
                isinstance(value, dict | list | tuple)
                and all(leaf is None for leaf in pytree.tree_leaves(value))
            ):
                dropped.append(name)
            elif isinstance(value, _PRIMITIVES):
                constants[name] = value
            else:
                hint = (
                    "call the model with use_cache=False so no cache object reaches the graph"
                    if "cache" in type(value).__name__.lower()
                    else "capture a submodule whose call does not take it (capture.submodules)"
                )
                raise ExportError(
                    f"kwarg '{name}' is a {describe(value)}: neither a tensor, a container of tensors nor a "
                    f"constant, so it cannot be a graph input; {hint}"
                )
        return tensors, constants, dropped


@dataclass
class CapturedGraph:
    """What one export did, for the export stage's files and the report. What travels with the graph
    to later stages is its GraphRecord (pipeline.graphs)."""

    path: str  # dotted path in the parent model; "" when the whole model was captured
    graph_module: torch.fx.GraphModule
    tensor_inputs: list[str]
    constants: dict[str, Any]  # baked into the graph; a call must pass the same values or none
    dropped: list[str]  # None-valued kwargs of the recorded call
    unread: list[str]  # constants the forward does not read (`reads`): left out of the graph
    dynamic_dims: dict[str, dict[int, str]]  # input name -> {dim: "batch" | "seq" | "image_tokens"}
    range_constraints: dict[str, str]
    export_s: float
    exported_nodes: int = 0  # the graph's nodes as export produced it (the transforms change the graph)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path or "root"

    def node_counts(self) -> dict[str, int]:
        """Nodes by op kind, and call_function nodes by target: what the graph is made of."""
        counts: Counter[str] = Counter()
        for node in self.graph_module.graph.nodes:
            counts[node.op] += 1
            if node.op == "call_function":
                counts[f"call_function:{node.target}"] += 1
        return dict(sorted(counts.items()))

    @property
    def num_nodes(self) -> int:
        """The graph's nodes now (after whatever rewrote it since export)."""
        return len(self.graph_module.graph.nodes)


def _bind(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional args by name, so the graph can be kwargs-only whatever the caller does."""
    if not args:
        return dict(kwargs)
    bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    named = dict(bound.arguments)
    for param in inspect.signature(module.forward).parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
    return named


def default_position_ids(config, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """What HF's models compute when given no position ids and no cache: offset..offset+S-1 per
    sequence (offset: 0, or 1 for PaliGemma, see models/probe.py), [B, S]; [3, B, S] for multimodal
    RoPE (Qwen2.5-VL), all three rows equal."""
    text_config = getattr(config, "text_config", None) or config
    batch, seq = tokens.shape[0], tokens.shape[1]
    # contiguous, as HF's own: Kosmos-2 views them flat to index its sinusoidal table
    positions = torch.arange(offset, offset + seq, device=tokens.device)[None].expand(batch, -1).contiguous()
    if (getattr(text_config, "rope_parameters", None) or {}).get("mrope_section"):
        return positions[None].expand(3, -1, -1)
    return positions


def reads(module: nn.Module, name: str) -> bool:
    """Whether the module's forward can read a kwarg: it or one of its submodules (where HF passes
    `**kwargs` down) names it, or lists it in a typed catch-all (`**kwargs: Unpack[...Kwargs]`). A
    name no forward inside lists reaches no code of the module (a VLM passes the head's
    `logits_to_keep` down to its decoder stack, which has no head): it is not baked into the graph,
    and a call may pass any value of it."""
    return any(_forward_reads(type(m), name) for m in module.modules())


@functools.cache
def _forward_reads(module_cls: type, name: str) -> bool:
    parameters = inspect.signature(module_cls.forward).parameters
    if name in parameters and parameters[name].kind is not inspect.Parameter.VAR_KEYWORD:
        return True
    catch_all = next((p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if catch_all is None:
        return False
    typed = [a for a in typing.get_args(catch_all.annotation) if typing.is_typeddict(a)]
    if catch_all.annotation is inspect.Parameter.empty or not typed:
        return True  # an untyped catch-all may read anything
    return any(name in t.__annotations__ for t in typed)


def with_position_ids(module: nn.Module, recorded: RecordedCall, offset: int) -> RecordedCall:
    """Position ids as a graph input: the runtime must tell a decode step where it is, and HF's
    models compute them from an arange when none are given, which export would bake in."""
    if "position_ids" not in inspect.signature(module.forward).parameters:
        return recorded
    if recorded.kwargs.get("position_ids") is not None:
        return recorded
    config = getattr(module, "config", None)
    positions = default_position_ids(config, first_tensor(recorded.kwargs), offset)
    return RecordedCall({**recorded.kwargs, "position_ids": positions})


def record_calls(model: nn.Module, paths: list[str], call: dict[str, Any]) -> dict[str, RecordedCall]:
    """Run the model until each submodule has been entered; returns the first call each received."""
    known = dict(model.named_modules())
    for path in paths:
        if path not in known:
            raise ExportError(
                f"capture.submodules: '{path}' is not a submodule of {type(model).__name__}; "
                f"top-level modules are {[name for name, _ in model.named_children()]}"
            )
    calls = first_calls(model, paths, call)
    missing = [p for p in paths if p not in calls]
    if missing:
        raise ExportError(
            f"submodule(s) {', '.join(missing)} did not run in the model's forward; check capture.submodules"
        )
    return {path: RecordedCall(_bind(known[path], *calls[path])) for path in paths}


def _tensor_dims(
    tensor: torch.Tensor, batch: int, seq: int, image_tokens: int = 0
) -> tuple[dict[int, Any], dict[int, str]]:
    spec: dict[int, Any] = {}
    marks: dict[int, str] = {}
    for i, size in enumerate(tensor.shape):
        if size == seq:
            spec[i], marks[i] = Dim.AUTO, "seq"
        elif size == batch and "batch" not in marks.values():
            spec[i], marks[i] = Dim.AUTO, "batch"
        elif image_tokens and size == image_tokens:
            spec[i], marks[i] = Dim.AUTO, "image_tokens"
    return spec, marks


def _key_name(path) -> str:
    return "_".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def dynamic_shape_spec(
    module: nn.Module, tensors: dict[str, Any], batch: int, seq: int, vision: dict[str, int] | None = None
) -> tuple[dict[str, Any], dict[str, dict[int, str]]]:
    """Dim.AUTO for every batch and sequence dim, matched by size (the example batch and sequence
    lengths are chosen so no other dim shares them), and in the vision inputs (`vision`: name -> the
    example's image-token count) every dim of that count; a container's tensors each get theirs, in
    the container's structure (named `<kwarg>_<key>`, as export names their placeholders). The spec
    follows the forward's signature: names that travel through **kwargs are nested under that
    parameter, as export requires."""
    vision = vision or {}
    dims: dict[str, dict[int, str]] = {}
    params = inspect.signature(module.forward).parameters
    var_kw = next((p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    nested: dict[str, Any] = {}
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            spec, dims[name] = _tensor_dims(value, batch, seq, vision.get(name, 0))
            spec = spec or None
        else:
            leaves, structure = pytree.tree_flatten_with_path(value)
            specs = []
            for path, leaf in leaves:
                if leaf is None:
                    specs.append(None)
                    continue
                leaf_spec, dims[f"{name}_{_key_name(path)}"] = _tensor_dims(
                    leaf, batch, seq, vision.get(name, 0)
                )
                specs.append(leaf_spec or None)
            spec = pytree.tree_unflatten(specs, structure)
        if name in params or var_kw is None:
            nested[name] = spec
        else:
            nested.setdefault(var_kw, {})[name] = spec
    return nested, dims


@contextlib.contextmanager
def constants_bound(module: nn.Module, constants: dict[str, Any]) -> Iterator[None]:
    """Export sees a forward with the constants already bound, so they are baked into the graph and
    the graph's inputs are the tensors alone (a dynamic_shapes entry for a constant that travels
    through **kwargs is rejected by export, as Llama-4's output_attentions is)."""
    module.forward = functools.partial(module.forward, **constants)
    try:
        yield
    finally:
        del module.forward  # the instance attribute; the class's forward shows again


def export_module(
    module: nn.Module,
    path: str,
    recorded: RecordedCall,
    batch: int,
    seq: int,
    position_offset: int = 0,
    text_call: RecordedCall | None = None,
    image_tokens: int = 0,
) -> CapturedGraph:
    """position_offset: where the model's own positions start (models/probe.py): the graph's default
    when a call gives none. text_call: the module's call from a text-only parent call, beside
    `recorded` from an image call with `image_tokens` image tokens: the inputs only the image call
    gives are vision inputs (VisionInput), their image-token dims dynamic."""
    tensors, constants, dropped = with_position_ids(module, recorded, position_offset).split()
    unread = [name for name in constants if not reads(module, name)]
    constants = {k: v for k, v in constants.items() if k not in unread}
    vision = {}
    if text_call is not None:
        vision = {n: image_tokens for n in tensors if text_call.kwargs.get(n) is None and n != "position_ids"}
    spec, dims = dynamic_shape_spec(module, tensors, batch, seq, vision)
    start = time.perf_counter()
    # On failure torch prints the partial graph (hundreds of lines) to stderr: keep it for the
    # run's logs instead of the console.
    stderr = io.StringIO()
    try:
        # A vision input's image-token dim is 0 in a call without images: export must not assume
        # its sizes >= 2, as it does of a dim seen at 2 or more (size-oblivious for backed sizes)
        oblivious = shape_config.patch(backed_size_oblivious=bool(vision))
        with (
            torch.no_grad(),
            constants_bound(module, constants),
            contextlib.redirect_stderr(stderr),
            oblivious,
        ):
            program = torch.export.export(module, (), tensors, dynamic_shapes=spec, strict=False)
    except Exception as exc:
        raise ExportFailed(stderr.getvalue(), path) from exc
    graph_module = program.module()
    export_s = time.perf_counter() - start
    captured = CapturedGraph(
        path=path,
        graph_module=graph_module,
        tensor_inputs=list(tensors),
        constants=constants,
        dropped=dropped,
        unread=unread,
        dynamic_dims=dims,
        range_constraints={str(k): str(v) for k, v in program.range_constraints.items()},
        export_s=export_s,
        exported_nodes=len(graph_module.graph.nodes),
    )
    _check_dynamic(program, captured)
    set_record(
        graph_module,
        GraphRecord(
            path,
            getattr(module, "config", None),
            list(tensors),
            dict(constants),
            position_offset=position_offset,
            unused_inputs=unread,
            vision_inputs=_vision_inputs(module, path, tensors, dims, vision, text_call),
            original=module,
        ),
    )
    _install_kwargs_adapter(graph_module, module)
    _keep_parent_interface(graph_module, module)
    return captured


def _vision_inputs(
    module: nn.Module,
    path: str,
    tensors: dict[str, Any],
    dims: dict[str, dict[int, str]],
    vision: dict[str, int],
    text_call: RecordedCall | None,
) -> dict[str, VisionInput]:
    """The empty form of each vision input, checked on the eager module with the text-only call:
    the same output with the empty inputs as with None. A module where no image tokens is not the
    same as no vision input (cross-attention over no states) cannot take a text call as one graph."""
    if not vision:
        return {}
    out = {}
    empty_tokens = cross_attention.ZERO_STATES if cross_attention.STATES in vision else 0
    for name in vision:
        leaves, structure = pytree.tree_flatten_with_path(tensors[name])
        shapes = []
        for key_path, leaf in leaves:
            marks = (
                dims[name]
                if isinstance(tensors[name], torch.Tensor)
                else dims[f"{name}_{_key_name(key_path)}"]
            )
            shapes.append((tuple(marks.get(i, size) for i, size in enumerate(leaf.shape)), leaf.dtype))
        out[name] = VisionInput(pytree.tree_structure(tensors[name]), shapes, empty_tokens)
    call = {k: v for k, v in text_call.kwargs.items() if k not in vision}
    tokens = first_tensor(call)
    with torch.no_grad():
        without = module(**call)
        empty = module(**call, **{n: v.empty(tokens) for n, v in out.items()})
    if not torch.equal(_first_tensor_of(without), _first_tensor_of(empty)):
        raise ExportError(
            f"graph '{path or 'root'}' takes {sorted(vision)} only from an image call, and empty ones "
            "(no image tokens) do not compute what a text call without them does; capture=none runs "
            "the model eager"
        )
    return out


def _first_tensor_of(output: Any) -> torch.Tensor:
    """A module's main output: the tensor, or the first tensor of its output object or tuple."""
    return next(leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor))


def _check_dynamic(program, captured: CapturedGraph) -> None:
    """Dim.AUTO never fails export; it specializes silently. Say so when it did."""
    placeholders = {n.name: n for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    for name, marks in captured.dynamic_dims.items():
        node = placeholders.get(name)
        value = node.meta.get("val") if node is not None else None
        if value is None:
            continue
        for dim, role in marks.items():
            if not isinstance(value.shape[dim], torch.SymInt):
                captured.notes.append(
                    f"{name} dim {dim} ({role}) was specialized to {value.shape[dim]} by export"
                )


def _install_kwargs_adapter(graph_module: nn.Module, original: nn.Module) -> None:
    """Map the parent's call onto the graph's exact kwargs before export's own input check runs;
    the contract is the graph's record (its inputs, its constants, and the provider of the inputs
    the graph gained after export)."""
    signature_owner = original

    def adapt(module, args, kwargs):
        record = record_of(module)
        inputs = set(record.tensor_inputs)
        call = _bind(signature_owner, args, kwargs)
        adapted: dict[str, Any] = {}
        for name, value in call.items():
            if name == "position_ids" and value is None and name in inputs:
                adapted[name] = default_position_ids(
                    signature_owner.config, first_tensor(call), record.position_offset
                )
            elif name == cross_attention.STATES and value is not None and name in inputs:
                adapted[name] = cross_attention.graph_states(value, first_tensor(call).shape[0])
            elif name in inputs and value is None and name in record.vision_inputs:
                adapted[name] = record.vision_inputs[name].empty(first_tensor(call))
            elif name in inputs:
                adapted[name] = value
            elif name in record.unused_inputs:
                continue
            elif name in record.constants:
                if value != record.constants[name]:
                    raise ExportError(
                        f"graph '{record.name}' was exported with {name}={record.constants[name]!r} "
                        f"and called with {name}={value!r}; capture the model with that call instead"
                    )
            elif value is not None:
                raise ExportError(
                    f"graph '{record.name}' was exported without '{name}' and was called with it "
                    f"({type(value).__name__}); its inputs are {sorted(inputs)}"
                )
        for name in (
            record.vision_inputs.keys() - adapted.keys() - {*record.unused_inputs}
        ):  # a call without them
            adapted[name] = record.vision_inputs[name].empty(first_tensor(call))
        if "position_ids" in inputs and "position_ids" not in adapted:
            adapted["position_ids"] = default_position_ids(
                signature_owner.config, first_tensor(call), record.position_offset
            )
        # Inputs the graph gained after export (insert_cached_attention's cache and metadata).
        if record.runtime_inputs is not None:
            adapted.update(record.runtime_inputs({**call, **adapted}))
        return (), adapted

    graph_module.register_forward_pre_hook(adapt, with_kwargs=True, prepend=True)


def _keep_parent_interface(graph_module: nn.Module, original: nn.Module) -> None:
    """What the eager parent still asks of its child: the input embeddings (a VLM embeds the text
    tokens itself before calling the language model, by method or by attribute, as Llama-4's
    `self.model.embed_tokens`), the config and the child's plain attributes. The real embedding
    module goes back at its own path; its weight is the same Parameter the graph holds, so nothing
    is copied. These are for Hugging Face's code; the pipeline reads the graph's record."""
    embeddings = original.get_input_embeddings() if hasattr(original, "get_input_embeddings") else None
    if isinstance(embeddings, nn.Module):
        path = next((name for name, mod in original.named_modules() if mod is embeddings), None)
        if path:
            graph_module.set_submodule(path, embeddings, strict=False)
        object.__setattr__(graph_module, "get_input_embeddings", lambda: embeddings)
    if hasattr(original, "config"):
        object.__setattr__(graph_module, "config", original.config)
    # and the plain values it reads (Chameleon's head masks the image-code ids its child's
    # `vocabulary_mapping` names)
    for name, value in vars(original).items():
        if (
            not name.startswith("_")
            and not isinstance(value, nn.Module | torch.Tensor)
            and not hasattr(graph_module, name)
        ):
            object.__setattr__(graph_module, name, value)


def eager_parts(model: nn.Module, captured_paths: list[str]) -> list[str]:
    """The outermost modules left eager: siblings along the way to each captured graph."""
    parts: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if path in captured_paths:
                continue
            if any(c.startswith(path + ".") for c in captured_paths):
                walk(child, path + ".")
            else:
                parts.append(path)

    walk(model, "")
    return parts


def capture(
    model: nn.Module,
    paths: list[str],
    call: dict[str, Any],
    position_offset: int = 0,
    text_call: dict[str, Any] | None = None,
) -> tuple[nn.Module, list[CapturedGraph]]:
    """Export each path ("" = the whole model) from `call` and swap it in; returns the new root.
    The batch and sequence sizes come from the call's input_ids: [B, S]. position_offset: where the
    model's positions start (models/probe.py). text_call: a text-only call beside an image `call`,
    which tells the inputs a submodule gets from images alone (`export_module`)."""
    if paths == [""]:
        recorded = {"": RecordedCall(dict(call))}
    else:
        recorded = record_calls(model, paths, call)
    # A submodule that takes inputs from an image call which a text-only call leaves None
    text_calls = (
        record_calls(model, paths, text_call) if text_call and call is not text_call and paths != [""] else {}
    )
    batch, seq = call["input_ids"].shape
    image_tokens = 0
    if text_calls and image_mask.MASK in call:  # the places the mask marks (models/image_mask.py)
        image_tokens = int(call[image_mask.MASK].sum())
    elif text_calls:
        image_tokens = int((call["input_ids"] == imaging.image_token_id(model.config)).sum())
    for recorded_call in recorded.values():
        states = recorded_call.kwargs.get(cross_attention.STATES)
        if states is not None:  # vision states, the image-token dim of a cross-attention family's
            recorded_call.kwargs[cross_attention.STATES] = cross_attention.graph_states(states, batch)
            image_tokens = recorded_call.kwargs[cross_attention.STATES].shape[1]
    captured = []
    for path in paths:
        module = model.get_submodule(path) if path else model
        graph = export_module(
            module, path, recorded[path], batch, seq, position_offset, text_calls.get(path), image_tokens
        )
        model = install(model, graph)
        captured.append(graph)
    return model, captured


def install(model: nn.Module, captured: CapturedGraph) -> nn.Module:
    """Swap the graph in; returns the new root (the graph itself when the whole model was captured)."""
    if not captured.path:
        return captured.graph_module
    model.set_submodule(captured.path, captured.graph_module)
    return model


def module_of_failure(exc: BaseException, model: nn.Module) -> str | None:
    """The deepest module of `model` whose forward was on the stack when `exc` was raised."""
    names = {id(m): (path or type(model).__name__) for path, m in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found

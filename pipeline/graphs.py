"""What a captured graph carries between stages, and the graph helpers several packages share.

A `GraphModule` that export swapped into the model holds one `GraphRecord` in `gm.meta["pipeline"]`
(AutoDeploy keeps its per-graph state in the graph module the same way): where it sits, the config
of the module it replaced, its kwargs contract (tensor inputs, baked-in constants), and, once
`insert_cached_attention` ran, its KV cache layout and the provider of the runtime inputs. Every
package reads it through `record_of`; nothing is stored as a loose attribute, except what the eager
parent itself asks of its child (`config`, `get_input_embeddings`), which export keeps for it.

Also here, because export, transforms, backends, runtime and the profiler all need them and must
not import each other for it: `find_graphs`, `find_language_models`, `first_tensor` and the names
of the profiler's module ranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree
from torch import fx, nn

from pipeline.attention.kv_cache import CacheSpec

RECORD_KEY = "pipeline"

# Runtime inputs a graph gained after export (KV caches, step metadata), from the call's kwargs as
# the parent made them (HF's mask included, which the graph itself may no longer take).
RuntimeInputs = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class VisionInput:
    """A graph input only an image call gives the language model (Qwen3-VL's DeepStack features and
    the mask of their tokens): a call without images leaves it None, and the graph gets its empty
    form instead, no image tokens, which export checked does what None does."""

    structure: Any  # the pytree spec of the value (a tensor, or a list of them)
    # per leaf: its shape, each dim a size or "batch" / "seq" (the call's) or "image_tokens"
    leaves: list[tuple[tuple[int | str, ...], torch.dtype]]
    # image tokens of the empty form: 0, or for cross-attention states the zero states, which add
    # nothing (models/cross_attention.py: a graph that infers a view's size from them needs some)
    empty_tokens: int = 0

    def empty(self, tokens: torch.Tensor) -> Any:
        """tokens: the call's input_ids [B, S] or inputs_embeds [B, S, H]."""
        sizes = {"batch": tokens.shape[0], "seq": tokens.shape[1], "image_tokens": self.empty_tokens}
        leaves = [
            torch.zeros([sizes.get(d, d) for d in shape], dtype=dtype, device=tokens.device)
            for shape, dtype in self.leaves
        ]
        return torch.utils._pytree.tree_unflatten(leaves, self.structure)


@dataclass
class Segment:
    """One segment of a graph split for piecewise capture (transforms/split_piecewise.py)."""

    index: int
    kind: str  # static (captured per token bucket) | layout (runs eagerly) | head (the logits)
    nodes: list[str]  # the graph's node names, in order
    modules: list[str] = field(default_factory=list)  # the outermost modules its nodes ran under

    def describe(self) -> str:
        where = f" in {self.modules[0]}" + (f" .. {self.modules[-1]}" if len(self.modules) > 1 else "")
        return f"segment {self.index} {self.kind}: {len(self.nodes)} nodes{where if self.modules else ''}"


@dataclass
class GraphRecord:
    path: str  # dotted path in the parent model; "" when the whole model was captured
    config: Any  # the HF config of the module the graph replaced
    tensor_inputs: list[str]  # the graph's kwargs as exported
    constants: dict[str, Any]  # values baked in at export; a call must pass the same or none
    language_model_prefix: str = ""  # in a full graph of a VLM: where the decoder sits inside it
    position_offset: int = 0  # where the model's positions start (PaliGemma: 1), see models/probe.py
    cache_specs: list[CacheSpec] = field(default_factory=list)  # one per cached attention layer
    runtime_inputs: RuntimeInputs | None = None  # fills the cache and metadata inputs of a call
    # Inputs the graph no longer reads (HF's mask, once cached attention replaced the attention that
    # read it): a call may still pass them, and they are not forwarded
    unused_inputs: list[str] = field(default_factory=list)
    vision_inputs: dict[str, VisionInput] = field(default_factory=dict)
    # insert_cached_attention, for a graph with cross-attention: the nodes that make its keys and
    # values of the vision states, split out (kwargs: the graph inputs they read; returns one tensor
    # per name of `cross_kv_inputs`, the graph inputs that take them), so a runtime makes them once
    # per request and keeps them as a KV cache (models/cross_attention.py)
    cross_kv: nn.Module | None = field(default=None, repr=False)
    cross_kv_inputs: list[str] = field(default_factory=list)
    # backend.piecewise=true: the graph's segments in order, each node's in its meta (SEGMENT)
    segments: list[Segment] = field(default_factory=list)
    # The eager module the graph replaced (its weights are the graph's, or were before a rewrite
    # copied them): what an eager reference profile runs in its place
    original: nn.Module | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.path or "root"

    @property
    def has_cache(self) -> bool:
        return bool(self.cache_specs)

    @property
    def text_config(self) -> Any:
        return getattr(self.config, "text_config", None) or self.config


# Node meta naming the decoder layer (its fqn in the model) whose output the node's value is: set at
# export (numerics.tag_layer_outputs), carried by rewrites (transforms/graph.replace) and kept alive
# by their dead-code pass, for the per-layer numerics.
LAYER_OUTPUT = "layer_output"
# Node meta: the index of the piecewise segment the node belongs to (GraphRecord.segments)
SEGMENT = "piecewise_segment"


def record_of(gm: nn.Module) -> GraphRecord:
    """The record of a captured graph; KeyError for a module export did not produce."""
    record = getattr(gm, "meta", {}).get(RECORD_KEY) if isinstance(gm, fx.GraphModule) else None
    if record is None:
        raise KeyError(f"{type(gm).__name__} is not a graph captured by the pipeline (no GraphRecord)")
    return record


def set_record(gm: fx.GraphModule, record: GraphRecord) -> None:
    gm.meta[RECORD_KEY] = record


# The nn_module_stack entry torch.export gives a node made outside any module (a hook's, a
# decomposition's): no module the model holds
EXPORT_PLACEHOLDER = "_empty_nn_module_stack_from_metadata_hook"


def module_paths(node: fx.Node) -> list[str]:
    """The paths of the modules a graph node ran under, outermost first (export's placeholder left
    out)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if path and path != EXPORT_PLACEHOLDER]


def find_graphs(model: nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """Every captured GraphModule in the model, outermost only ("root" when the model is one)."""
    found: list[tuple[str, fx.GraphModule]] = []
    for path, module in model.named_modules():
        if isinstance(module, fx.GraphModule) and not any(
            path.startswith(p + ".") or p == "" for p, _ in found
        ):
            found.append((path, module))
    return [(path or "root", module) for path, module in found]


def cached_graphs(model: nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """The captured graphs that have cached attention (what demollm and CUDA graphs drive)."""
    return [(name, gm) for name, gm in find_graphs(model) if record_of(gm).has_cache]


def _decoder_stack(module: nn.Module, text_config) -> bool:
    """A `layers` ModuleList of the text config's depth beside an input embedding of its vocabulary
    (or more: Mllama's text model embeds 8 image tokens past it)."""
    layers, embedding = getattr(module, "layers", None), getattr(module, "embed_tokens", None)
    return (
        isinstance(layers, nn.ModuleList)
        and len(layers) == text_config.num_hidden_layers
        and isinstance(embedding, nn.Embedding)
        and embedding.num_embeddings >= text_config.vocab_size
    )


def find_language_models(model: nn.Module, text_config) -> list[str]:
    """The decoder stack of a model, found by structure: the outermost modules holding the text
    config's `layers` and its token embedding (Llama-4's `language_model` is the CausalLM around
    its stack `language_model.model`). By structure, not by config identity: `from_pretrained`
    gives each submodule its own copy of the config."""
    found: list[str] = []
    for path, module in model.named_modules():
        if _decoder_stack(module, text_config) and not any(path.startswith(outer + ".") for outer in found):
            found.append(path)
    return found


def stack_candidates(model: nn.Module) -> list[str]:
    """Every module that holds a `layers` ModuleList, as `path (Class, N layers)`: what a message
    lists when the language model is not found, or not found once."""
    return [
        f"{path or '(root)'} ({type(module).__name__}, {len(module.layers)} layers"
        f"{', token embedding' if isinstance(getattr(module, 'embed_tokens', None), nn.Embedding) else ''})"
        for path, module in model.named_modules()
        if isinstance(getattr(module, "layers", None), nn.ModuleList)
    ]


def first_tensor(call: dict[str, Any]) -> torch.Tensor:
    """input_ids [B, S] or inputs_embeds [B, S, H]: the call's batch and sequence."""
    return next(call[k] for k in ("input_ids", "inputs_embeds") if isinstance(call.get(k), torch.Tensor))


# Profiler ranges named after modules: `module::<fqn>|<Class>`. The profiler puts them into graphs
# (profiler/ranges.py) and the engine names its own work with them.
RANGE_PREFIX = "module::"


def range_name(fqn: str, cls: str) -> str:
    return f"{RANGE_PREFIX}{fqn}|{cls}"


def parse_range(name: str) -> tuple[str, str] | None:
    """(fqn, class) of a `module::<fqn>|<Class>` range name."""
    if not name.startswith(RANGE_PREFIX):
        return None
    fqn, _, cls = name[len(RANGE_PREFIX) :].rpartition("|")
    return fqn, cls


@contextlib.contextmanager
def eager_graphs(model: nn.Module) -> Iterator[nn.Module]:
    """The model with every captured graph swapped back for the eager module it replaced (yields the
    root: the original model when the whole model was captured); the graphs go back on exit."""
    graphs = find_graphs(model)
    if len(graphs) == 1 and graphs[0][1] is model:
        yield record_of(model).original
        return
    for path, graph in graphs:
        model.set_submodule(path, record_of(graph).original)
    try:
        yield model
    finally:
        for path, graph in graphs:
            model.set_submodule(path, graph)

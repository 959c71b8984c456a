"""insert_cached_attention: every `pipeline::attention` becomes a cached attention op of the run's
`attention=` backend, which writes the new keys/values into a paged KV cache and attends over the
history.

The graph gains kwargs inputs: one cache per attention layer (`kv_cache_<i>`: [2, pages, page_size,
Hkv, D]) and the step's sequence metadata (`qo_indptr`, `cache_lens`, `page_table`), and one
`pipeline::attention_plan` node, before the first layer, that turns the metadata into per-token
sequence/position/slot tensors for all layers. The mask HF computed is dropped (and with it the
graph inputs only it read); what it meant goes to the op: the layer's sliding window or attention
chunk (Llama-4's chunked layers) from the text config's `layer_types`, the logit cap from the
matched attention, and, for a family whose prompt spans attend both ways (models/masks.py), a
`token_block` input [T, 2] the runtime fills from each request. In a full graph of a VLM only the language model's
attention (under the record's `language_model_prefix`, set at export) gets a cache. Cross-attention
(keys from vision states, not from the tokens: models/cross_attention.py) keeps its attention op;
its keys and values become graph inputs (`cross_key_<i>`, `cross_value_<i>`) and the nodes that
made them of the states a module of their own (`cross_kv` on the record), so a runtime makes them
once per request. The graph's
record then carries `cache_specs` (what to allocate) and a `runtime_inputs` provider the kwargs
adapter calls for those inputs: by default a fresh cache per call (each call is a prefill of new
sequences, so a plain forward still works and is checked against eager; its blocks are read from
the mask HF built for the call, or the call's token_type_ids); demollm binds its own.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

from pipeline import ops  # noqa: F401  (registers pipeline::attention)
from pipeline.attention import (
    cached_attention_op,
    common,  # noqa: F401  (registers pipeline::attention_plan)
)
from pipeline.attention.kv_cache import CacheSpec, PagedKVCache
from pipeline.graphs import first_tensor, record_of
from pipeline.models import cross_attention, masks
from pipeline.transforms.graph import add_inputs, drop_dead, drop_unused_inputs, is_op, replace
from pipeline.transforms.registry import Transform, TransformContext, register

ATTENTION = torch.ops.pipeline.attention.default
PLAN = torch.ops.pipeline.attention_plan.default
METADATA = ("qo_indptr", "cache_lens", "page_table")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _module_path(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    return stack[-1][0] if stack else ""


def _layer_index(node: fx.Node) -> int | None:
    match = _LAYER.search(_module_path(node) + ".")
    return int(match.group(1)) if match else None


def _from_tokens(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes computed from the call's tokens (input_ids or inputs_embeds), in one pass."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.target in ("input_ids", "inputs_embeds"):
                found.add(node)
        elif any(n in found for n in node.all_input_nodes):
            found.add(node)
    return found


def _in_language_model(node: fx.Node, prefix: str) -> bool:
    """Only the decoder's attention gets a cache: in a full graph of a VLM the vision tower's
    attention (bidirectional, over patches) is matched too and must stay as it is."""
    return not prefix or _module_path(node).startswith(prefix + ".")


def _window_and_chunk(text_config, layer: int | None) -> tuple[int, int]:
    """(sliding window, attention chunk) of a layer, 0 for none, as HF's mask would have applied."""
    types = getattr(text_config, "layer_types", None)
    if types and layer is not None and layer < len(types):
        kind = types[layer]
    else:
        kind = "sliding_attention" if getattr(text_config, "sliding_window", None) else "full_attention"
    if kind == "chunked_attention":
        return 0, int(text_config.attention_chunk_size)
    if kind == "sliding_attention":
        return int(text_config.sliding_window), 0
    return 0, 0


def _language_model_attention(gm: fx.GraphModule, from_tokens: bool) -> list[fx.Node]:
    """The attention ops in the language model whose keys are (or are not) made of the tokens."""
    prefix = record_of(gm).language_model_prefix
    of_tokens = _from_tokens(gm)
    return [
        n
        for n in gm.graph.nodes
        if is_op(n, ATTENTION) and _in_language_model(n, prefix) and (n.args[1] in of_tokens) == from_tokens
    ]


def _split_cross_kv(gm: fx.GraphModule, crossing: list[fx.Node]) -> tuple[fx.GraphModule, list[str]]:
    """Each cross-attention's keys and values become graph inputs (`cross_key_<i>`,
    `cross_value_<i>`: [B, Hkv, N, D]); the nodes that made them of the vision states go into a
    module of their own, which returns them in that order."""
    made = [value for node in crossing for value in node.args[1:3]]
    needed: set[fx.Node] = set()
    stack = list(made)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph, copies = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in needed:
            copies[node] = graph.node_copy(node, lambda n: copies[n])
    graph.output(tuple(copies[n] for n in made))
    module = fx.GraphModule(gm, graph, class_name="CrossKV")
    names = [f"cross_{kind}_{i}" for i in range(len(crossing)) for kind in ("key", "value")]
    inputs = dict(zip(names, add_inputs(gm, names), strict=True))
    for i, node in enumerate(crossing):
        node.args = (node.args[0], inputs[f"cross_key_{i}"], inputs[f"cross_value_{i}"], *node.args[3:])
    return module, names


class CrossKVInputs:
    """Runtime inputs of a plain call of a graph with cross-attention: the fresh cache's, and the
    keys and values made of the call's vision states (its empty form where it has none)."""

    def __init__(self, fresh: FreshCacheInputs, record):
        self.fresh, self.record = fresh, record

    def __call__(self, call: dict) -> dict[str, torch.Tensor]:
        first = first_tensor(call)
        vision = self.record.vision_inputs
        states = call.get(cross_attention.STATES)
        given = {
            cross_attention.STATES: cross_attention.graph_states(states, first.shape[0])
            if states is not None
            else vision[cross_attention.STATES].empty(first),
            **{n: call[n] for n in vision if n != cross_attention.STATES and n in call},
        }
        made = cross_attention.make_kv(self.record, given)
        return {**self.fresh(call), **dict(zip(self.record.cross_kv_inputs, made, strict=True))}


class FreshCacheInputs:
    """Runtime inputs for a plain forward call: the call's N sequences of S tokens are new.
    blocks: the model's HF config, for a graph that takes `token_block`."""

    def __init__(self, specs: list[CacheSpec], page_size: int, blocks=None):
        self.specs, self.page_size, self.blocks = specs, page_size, blocks

    def __call__(self, call: dict) -> dict[str, torch.Tensor]:
        first = first_tensor(call)  # input_ids [N, S] or inputs_embeds [N, S, H]
        batch, seq = first.shape[0], first.shape[1]
        cache = PagedKVCache(self.specs, batch * -(-seq // self.page_size) + 1, self.page_size, first.device)
        for i in range(batch):
            cache.reserve(i, seq)
        inputs = {**cache.tensors, **cache.metadata(list(range(batch)), [seq] * batch, first.device)}
        if self.blocks is not None:
            inputs["token_block"] = self._token_block(call, batch, seq, first.device)
        return inputs

    def _token_block(self, call: dict, batch: int, seq: int, device) -> torch.Tensor:
        """[N * S, 2]: from the mask HF built (what a language model graph receives), else the
        call's token_type_ids (a whole-model graph), else none."""
        blocks = masks.blocks_from_mask(call.get("attention_mask"))
        if blocks is None and isinstance(call.get("token_type_ids"), torch.Tensor):
            blocks = masks.blocks_from_token_types(self.blocks, call["token_type_ids"])
        if blocks is None:
            blocks = torch.zeros(batch, seq, 2, dtype=torch.long, device=device)
        return blocks.reshape(-1, 2).to(device)


@register
class InsertCachedAttention(Transform):
    name = "insert_cached_attention"
    decoding = makes_cache = True
    after = ("match_attention",)  # it replaces pipeline::attention

    def apply_graph(self, gm: fx.GraphModule, ctx: TransformContext) -> int:
        record = record_of(gm)
        nodes = self._attention_nodes(gm)
        if not nodes:
            return 0
        crossing = self._cross_attention_nodes(gm)
        op = cached_attention_op(ctx.attention)
        specs = []
        for i, node in enumerate(nodes):
            k_value = node.args[1].meta.get("val")  # [B, Hkv, S, D]
            if k_value is None:
                raise ValueError(f"{node.name}: no shape metadata on its keys")
            specs.append(
                CacheSpec(f"kv_cache_{i}", int(k_value.shape[1]), int(k_value.shape[3]), k_value.dtype)
            )
        blocks = ctx.hf_config is not None and masks.uses_blocks(ctx.hf_config)
        names = [s.input_name for s in specs] + list(METADATA) + (["token_block"] if blocks else [])
        inputs = dict(zip(names, add_inputs(gm, names), strict=True))
        metadata = [inputs[m] for m in METADATA]
        # Once per step, in the first layer's attention: every packed token's sequence, offset,
        # position and cache slot, which all layers share. It takes that attention's module stack,
        # so a profile counts it there whatever the backend (ranges, or Inductor's provenance).
        with gm.graph.inserting_before(nodes[0]):
            plan = gm.graph.call_function(PLAN, (nodes[0].args[0], inputs[specs[0].input_name], *metadata))
            tokens = [gm.graph.call_function(operator.getitem, (plan, i)) for i in range(4)]
        if "nn_module_stack" in nodes[0].meta:
            plan.meta["nn_module_stack"] = dict(nodes[0].meta["nn_module_stack"])
        for spec, node in zip(specs, nodes, strict=True):
            q, k, v, _mask, scale, _is_causal, softcap = node.args
            window, chunk = _window_and_chunk(record.text_config, _layer_index(node))
            with gm.graph.inserting_before(node):
                cached = gm.graph.call_function(
                    op,
                    (q, k, v, inputs[spec.input_name], *metadata, *tokens, inputs.get("token_block"), scale,
                     softcap, window, chunk),
                )  # fmt: skip
            replace(node, cached)
            gm.graph.erase_node(node)
        if crossing:
            record.cross_kv, record.cross_kv_inputs = _split_cross_kv(gm, crossing)
        drop_dead(gm)
        record.unused_inputs += drop_unused_inputs(gm)
        record.tensor_inputs = [n for n in record.tensor_inputs if n not in record.unused_inputs]
        record.cache_specs = specs
        fresh = FreshCacheInputs(specs, ctx.page_size, ctx.hf_config if blocks else None)
        record.runtime_inputs = CrossKVInputs(fresh, record) if crossing else fresh
        return len(nodes) + len(crossing)

    @staticmethod
    def _attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
        """The language model's self-attention: its keys come from the tokens."""
        return _language_model_attention(gm, from_tokens=True)

    @staticmethod
    def _cross_attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
        """The language model's cross-attention: keys from the vision states the call brings."""
        return _language_model_attention(gm, from_tokens=False)

    def unmatched(self, gm: fx.GraphModule) -> list[str]:
        if record_of(gm).has_cache or self._attention_nodes(gm):
            return []
        return [
            "no pipeline::attention op in the language model: match_attention rewrote none (its record says why)"
        ]

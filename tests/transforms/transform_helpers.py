"""What the transform tests share: tiny models with their language model captured, the eager
reference on the same calls, and a run of the configured transforms."""

from __future__ import annotations

import torch
from conftest import TINY_MODELS, build_tiny, capture_tiny, compose_cfg, transform_context

from pipeline.transforms import registry

# Per tiny model (2 text layers): attention layers, rotated tensors (q and k per RoPE layer),
# RMSNorms (2 per layer + final), residual adds fused into the norm after them (every norm but the
# first layer's input norm), fused GEMM groups (q/k/v and gate/up per layer), gated activations
# on a fused gate/up, and a cached attention per layer. Llama-4's second layer has no RoPE, its RoPE
# layer adds a weightless QK-norm, its gate/up is the shared expert's (with the router's columns),
# and its routed experts become one pipeline::moe per layer (their chunked bmm's gated activation
# goes with them).
TWO_LAYERS = dict(
    match_attention=2,
    match_rope=4,
    match_rmsnorm=5,
    match_moe=0,
    fuse_add_rmsnorm=4,
    fuse_gemms=4,
    fuse_silu_and_mul=2,
    insert_cached_attention=2,
)
EXPECTED = {name: TWO_LAYERS for name in TINY_MODELS} | {
    "tiny_llama4_scout": {**TWO_LAYERS, "match_rope": 2, "match_rmsnorm": 7, "match_moe": 2}
}


def captured(name: str, attn_implementation: str | None = None):
    """A tiny model with its language model (text models: the whole model) exported and swapped in,
    the check calls, and the eager logits on them."""
    model, hf_config, examples = build_tiny(name, attn_implementation=attn_implementation)
    calls = {"text": examples.text} | ({"image": examples.image} if examples.image else {})
    with torch.no_grad():
        reference = {k: model(**c).logits for k, c in calls.items()}
    model, _ = capture_tiny(model, hf_config, examples)
    return model, calls, reference


def assert_same(model, calls, reference, tol=1e-5):
    """Within tol of the largest logit (the wide tiny init makes logits of several units)."""
    with torch.no_grad():
        for key, call in calls.items():
            scale = max(1.0, reference[key].abs().max().item())
            torch.testing.assert_close(
                model(**call).logits, reference[key], rtol=0, atol=tol * scale, msg=key
            )


def run(model, overrides=()) -> registry.TransformHistory:
    """The configured transforms (conf/transforms/default.yaml with the overrides) on the model."""
    transforms = registry.parse(compose_cfg(list(overrides)).transforms)
    history = registry.TransformHistory()
    registry.run_transforms(model, transforms, transform_context(), history)
    return history


def apply(name: str, gm) -> int:
    """One transform's subgraph pass on a graph, with its default options, as the registry runs it
    (the graph cleaned up and recompiled after the rewrite)."""
    return registry.TRANSFORMS[name](registry.TransformConfig()).rewrite_graph(gm, transform_context())

"""torch-compile: Inductor on each captured graph's forward, dynamic shapes.

The forward is replaced on the graph module itself, so its kwargs adapter (a forward pre-hook)
still runs eagerly in front, and the module tree, attribute names and profiler module events stay
those of the graph module.

Inductor compiles the canonical elementwise ops (rms_norm, add_rms_norm, rope, silu_and_mul) from
their aten definitions, so they fuse with their neighbours (the q/k split before RoPE, the residual
add before a norm where fuse_add_rmsnorm is off) instead of running as opaque calls; attention and
linear stay library kernels. Eager and torch-simple runs keep the ops as they are.

pipeline::moe stays an opaque call (its routed implementation). Measured under torch-compile at
one decode token against a decomposition into torch ops that gathers each token-expert pair's
weights into one batched GEMV: for small experts (small_mixtral) the gathered form was faster, for
Llama-4 Scout's large bfloat16 experts slower (copying a large expert costs more than the
host-side grouping), and an all-experts decomposition was about twice the opaque op's step on
small_mixtral. Choosing per call is not possible: a decomposition that declines (NotImplemented)
for large experts or prefill leaves Inductor a fallback for the op, and Inductor then refuses the
decomposition in the next graph of the process ("both a fallback and a decomp for same op"). So
the op stays opaque, the better choice for the large experts.
"""

from __future__ import annotations

import hashlib
import inspect

import torch
from torch import fx, nn
from torch._inductor.decomposition import register_decomposition
from torch.fx.experimental import _config as fx_config

from pipeline.backends.compile_log import LOG
from pipeline.ops import (
    add_rms_norm_reference,
    rms_norm_reference,
    rope_reference,
    silu_and_mul_reference,
)

_DECOMPOSED = {
    torch.ops.pipeline.rms_norm.default: rms_norm_reference,
    torch.ops.pipeline.add_rms_norm.default: add_rms_norm_reference,
    torch.ops.pipeline.rope.default: rope_reference,
    torch.ops.pipeline.silu_and_mul.default: silu_and_mul_reference,
}
for _op, _reference in _DECOMPOSED.items():
    register_decomposition(_op)(_reference)
# Inductor's on-disk caches do not key on the decomposition table: without a tag of their source, a
# graph compiled before (the ops opaque) would be loaded as it was.
_SOURCE = "".join(inspect.getsource(f) for f in _DECOMPOSED.values())
torch.compiler.config.cache_key_tag += (
    f"pipeline-decompositions-{hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]}"
)


def compiled_frames() -> int:
    """Frames Dynamo has compiled in this process: a later count above the first is a recompile."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def _plain(value):
    """A tensor input as Dynamo should meet it: dense and not a view. Dynamo guards on a view's base
    and on strides, so the same step built as a view (positions[None]) or expanded (HF's default
    position_ids, stride 0) would each compile again."""
    if not isinstance(value, torch.Tensor):
        return value
    if not value.is_contiguous():
        return value.contiguous()
    return value if value._base is None else value.detach()


def compile_module(module: nn.Module, name: str = "") -> None:
    """Inductor on the module's forward, sizes symbolic from the first call on; name: the graph's
    path, which its compiles are recorded under (compile_log.LOG).

    On an exported graph, without duck shaping: two sizes that happen to match in one call (the
    sequences and the page-table width, the batch and the cache's K/V pair) are not tied, which
    would compile again when the next step's differ. Sizes 0 and 1 stay what Dynamo specializes,
    so a one-token or one-sequence step compiles apart from a longer one; the capture stage warms
    up each kind generation meets (stages/capture.py), and the page table is never one column
    wide (attention/kv_cache.py). The eager model (capture=none) compiles as torch.compile does."""
    LOG.install()
    compiled = torch.compile(module.forward, dynamic=True)
    if not isinstance(module, fx.GraphModule):
        module.forward = compiled
        return

    def forward(*args, **kwargs):
        kwargs = {name: _plain(value) for name, value in kwargs.items()}
        # Read only when a call compiles; set per call (config.patch costs 4x more a step).
        duck = fx_config.use_duck_shape
        fx_config.use_duck_shape, LOG.graph = False, name
        try:
            return compiled(*args, **kwargs)
        finally:
            fx_config.use_duck_shape, LOG.graph = duck, ""

    module.forward = forward

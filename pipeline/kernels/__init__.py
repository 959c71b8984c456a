"""Triton kernels behind canonical ops on CUDA (registered by ops.py and
attention/common.py through `library.op(..., cuda=...)`).

Each replaces a chain of small aten kernels with one launch: the reference rms_norm is eight
kernels, rope five, the attention plan about eighteen, and a decode step of a two-layer model runs
five norms, four ropes and one plan. The moe kernel is the exception: two grouped GEMMs over the
routed experts whose point is reading nothing on the host (CUDA graphs) and only the routed
experts' weights. At decode the kernels are tiny, so their number can weigh as
much as their work; what the kernels are worth is measured by the GPU bench's "aten ops" row,
which runs the chains instead. Each kernel rounds where the aten chain rounds, so results match
the reference but for float32 summation order and silu's exp. Without a GPU the tests run them in
Triton's interpreter.
"""

import importlib.util

if importlib.util.find_spec("triton") is not None:
    from pipeline.kernels.triton_attention_plan import attention_plan
    from pipeline.kernels.triton_moe import moe
    from pipeline.kernels.triton_rms_norm import add_rms_norm, rms_norm
    from pipeline.kernels.triton_rope import rope
    from pipeline.kernels.triton_silu_and_mul import silu_and_mul
else:  # no Triton (torch's CUDA builds ship it): CUDA runs the reference implementations
    add_rms_norm = attention_plan = moe = rms_norm = rope = silu_and_mul = None

__all__ = ["add_rms_norm", "attention_plan", "moe", "rms_norm", "rope", "silu_and_mul"]

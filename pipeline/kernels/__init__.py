"""Triton kernels behind canonical ops on CUDA (registered by transforms/ops.py and
attention/common.py through `library.op(..., cuda=...)`).

Each replaces a chain of small aten kernels with one launch. At decode a step's kernels are tiny
and the GPU time between them (a few microseconds each, even inside a CUDA graph) adds up: the
reference rms_norm is eight kernels, rope five, the attention plan about eighteen, and a decode
step of a two-layer model runs five norms, four ropes and one plan. Each kernel rounds where the
aten chain rounds, so results match the reference to the last bit but for float32 summation
order. Without a GPU the tests run them in Triton's interpreter.
"""

import importlib.util

if importlib.util.find_spec("triton") is not None:
    from pipeline.kernels.triton_attention_plan import attention_plan
    from pipeline.kernels.triton_rms_norm import add_rms_norm, rms_norm
    from pipeline.kernels.triton_rope import rope
    from pipeline.kernels.triton_silu_and_mul import silu_and_mul
else:  # no Triton (torch's CUDA builds ship it): CUDA runs the reference implementations
    add_rms_norm = attention_plan = rms_norm = rope = silu_and_mul = None

__all__ = ["add_rms_norm", "attention_plan", "rms_norm", "rope", "silu_and_mul"]
